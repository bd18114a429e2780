"""KV block pool and state pool: sized from a memory budget, allocated once, laid out for coalescing."""

import pytest
import torch

from baton.engine.cache_pools import CachePools, plan_cache
from baton.engine.config import ModelConfig
from baton.engine.engine_config import EngineConfig
from baton.engine.make_model import build_config
from baton.engine.model import NemotronHForCausalLM
from baton.engine.penalty_counts import PenaltyCounts
from baton.engine.state_spec import STATE_DTYPE, StateSpec, StateTensor
from baton.transfer.layout import RegionLayout
from baton.transfer.plan import plan_slots


@pytest.fixture(scope="module")
def cfg():
    return ModelConfig.from_hf_dict(build_config("tiny"))


def test_a_prefill_only_engine_sets_nothing_aside_for_penalties(cfg):
    ecfg = EngineConfig(block_size=8, max_num_seqs=4, cache_memory_bytes=2 * 2**20, prefill_only=True)
    assert plan_cache(cfg, NemotronHForCausalLM.state_spec(cfg), ecfg, torch.float32, torch.float32).penalty_bytes == 0


def test_plan_fits_the_budget_exactly(cfg):
    ecfg = EngineConfig(block_size=8, max_num_seqs=4, cache_memory_bytes=2 * 2**20)
    plan = plan_cache(cfg, NemotronHForCausalLM.state_spec(cfg), ecfg, torch.float32, torch.float32)
    n_attn, n_mamba = len(cfg.attention_layer_ids), len(cfg.mamba_layer_ids)
    assert plan.block_bytes == n_attn * 2 * 8 * cfg.num_key_value_heads * cfg.head_dim * 4
    conv = cfg.conv_dim * (cfg.conv_kernel - 1) * 4
    ssm = cfg.mamba_num_heads * cfg.mamba_head_dim * cfg.ssm_state_size * 4
    assert plan.slot_bytes == n_mamba * (conv + ssm)
    # The budget includes one scratch block and slot past the plan's (CUDA-graph padding rows write there), the
    # prefix cache's checkpoints (one per slot by default, each a slot's states), and the sampler's penalty tables,
    # which hold exactly the bytes set aside for them once allocated.
    assert plan.num_checkpoints == 4 and plan.checkpoint_bytes == plan.slot_bytes
    tables = PenaltyCounts(plan.num_slots, cfg.vocab_size, torch.device("cpu"))
    tables.resident([0], [None], [None], [False])
    assert tables.counts.nbytes + tables.prompt_bits.nbytes == (plan.num_slots + 1) * plan.penalty_bytes > 0
    used = ((plan.num_blocks + 1) * plan.block_bytes + (plan.num_slots + 1) * (plan.slot_bytes + plan.penalty_bytes)
            + plan.num_checkpoints * plan.checkpoint_bytes)
    assert used <= ecfg.cache_memory_bytes < used + plan.block_bytes
    pools = CachePools(cfg, plan, 8, torch.float32, torch.float32, "cpu")
    assert pools.kv.numel() * 4 == (plan.num_blocks + 1) * plan.block_bytes
    assert (pools.states["conv"].numel() + pools.states["ssm"].numel()) * 4 == (plan.num_slots + 1) * plan.slot_bytes
    assert pools.kv.shape == (plan.num_blocks + 1, n_attn, 2, 8, cfg.num_key_value_heads, cfg.head_dim)
    assert pools.states["ssm"].shape == (5, n_mamba, cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size)
    assert pools.states["conv"].shape == (5, n_mamba, cfg.conv_dim, cfg.conv_kernel - 1)


def test_a_run_of_blocks_or_one_slot_is_one_contiguous_region_for_all_layers(cfg):
    plan = plan_cache(cfg, NemotronHForCausalLM.state_spec(cfg), EngineConfig(block_size=8, max_num_seqs=3, num_kv_blocks=10), torch.float32,
                      torch.float32)
    pools = CachePools(cfg, plan, 8, torch.float32, torch.float32, "cpu")
    run = pools.kv[3:6]  # blocks 3, 4, 5: K and V of every attention layer
    assert run.is_contiguous() and run.numel() * 4 == 3 * plan.block_bytes
    assert run.data_ptr() - pools.kv.data_ptr() == 3 * plan.block_bytes
    assert pools.states["ssm"][1].is_contiguous() and pools.states["conv"][1].is_contiguous()
    assert (pools.states["ssm"][1].numel() + pools.states["conv"][1].numel()) * 4 == plan.slot_bytes
    # The layers see strided views of the same storage.
    pools.kv_layers()[1][4, 0].fill_(7.0)
    assert pools.kv[4, 1, 0].eq(7.0).all() and pools.kv[4, 0].eq(0).all()


def test_bf16_state_halves_ssm_bytes(cfg):
    e = EngineConfig(max_num_seqs=4)
    assert (plan_cache(cfg, NemotronHForCausalLM.state_spec(cfg), e, torch.float32, torch.bfloat16).slot_bytes
            < plan_cache(cfg, NemotronHForCausalLM.state_spec(cfg), e, torch.float32, torch.float32).slot_bytes)


def test_budget_too_small_names_the_field(cfg):
    with pytest.raises(ValueError, match="cache_memory_bytes"):
        plan_cache(cfg, NemotronHForCausalLM.state_spec(cfg), EngineConfig(max_num_seqs=32, cache_memory_bytes=1024), torch.float32, torch.float32)


def test_pools_and_slot_transfer_hold_whatever_the_mixer_declares(cfg):
    """Another mixer's declaration (a conv window and a recurrent state of its own, one verify input) gets pools of
    its names and sizes, and a slot READ of one descriptor per declared state: no pool or transfer code names a
    mixer."""
    spec = StateSpec(num_layers=3, states=(StateTensor("conv", (24, 3)), StateTensor("recurrent", (2, 4, 8),
                                                                                      STATE_DTYPE)),
                     verify_inputs=(StateTensor("qkv", (24,)),))
    ecfg = EngineConfig(block_size=8, max_num_seqs=3, num_kv_blocks=10, num_speculative_tokens=2)
    plan = plan_cache(cfg, spec, ecfg, torch.float32, torch.bfloat16)
    assert plan.slot_bytes == 3 * (24 * 3 * 4 + 2 * 4 * 8 * 2 + 3 * 24 * 4)
    pools = CachePools(cfg, plan, 8, torch.float32, torch.bfloat16, "cpu")
    assert list(pools.by_name()) == ["kv", "conv", "recurrent"]
    assert pools.states["recurrent"].shape == (4, 3, 2, 4, 8) and pools.states["recurrent"].dtype == torch.bfloat16
    assert pools.verify["qkv"].shape == (4, 3, 3, 24)
    assert len(pools.state_layers()) == len(pools.verify_layers()) == 3
    assert pools.state_layers()[1][1].data_ptr() == pools.states["recurrent"][:, 1].data_ptr()
    regions = {n: RegionLayout.of(n, t) for n, t in pools.by_name().items()}
    slot = plan_slots(regions, regions, 1, 2)
    assert slot.num_descriptors == 2 and slot.num_bytes == plan.slot_bytes - 3 * 3 * 24 * 4
    with pytest.raises(ValueError, match="unique names other than 'kv'"):
        StateSpec(num_layers=1, states=(StateTensor("kv", (1,)),))
