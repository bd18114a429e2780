"""Tensor parallelism inside a node (issue #50), exact on CPU: TP = 2 and 4 ranks (gloo, one process each) give the
TP = 1 greedy tokens, drafts and acceptance counts, and its prefill logits within fp32 tolerance, for NemotronH
(dense, MoE, MTP K=2) and Qwen3.5 (dense, MTP K=2), FP8 checkpoints of both formats among them, and every rank
agrees on them (R3 across ranks). A config that cannot be split is refused naming the field, and an FP8 block scale
that a split would cut is refused naming the weight.

The ranks of each TP size run every model in one spawn (`tests/tp_harness.py`): the processes' start and torch
import are the larger part of the time on a 2-core box.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from baton.engine.config import ModelConfig
from baton.engine.engine_config import EngineConfig
from baton.engine.fp8_checkpoint import (
    dequantize_state,
    quantize_state,
    unquantized_linears,
)
from baton.engine.layers.qwen_moe import QwenSparseMoE
from baton.engine.llm_engine import LLMEngine
from baton.engine.loader import load_checkpoint
from baton.engine.make_model import build_config, make_model
from baton.engine.make_model_qwen3_5 import qwen3_5_config
from baton.engine.ops.fp8_linear.reference import FP8_DTYPE, dequantize
from baton.engine.ops.kernels import bind_kernels, resolve_kernels
from baton.engine.ops.moe.reference import dequantize_experts, expert_scale_shape
from baton.engine.parallel.group import TPGroup
from baton.engine.parallel.parallel_config import ParallelConfig
from baton.engine.parallel.shard_config import shard_config
from baton.engine.parallel.shard_weights import shard_state_dict
from baton.engine.parallel.vocab import per_rank, shard_rows
from baton.engine.quant_config import FP8, FP8Config
from baton.engine.weights import expected_weight_shapes
from tests.fp8_rewrite import quantize_blockwise
from tests.tp_harness import Job, run_ranks, run_single

# (name, preset, mtp layers, overrides, K[, FP8 block or "fp8" per tensor]), each run at TP = 1, 2 and 4. The overrides give 4 Mamba2 groups and 4 Gated
# DeltaNet key heads (the presets have 2) so that 4 ranks split them; 4 ranks replicate the presets' 2 KV heads.
MODELS = [
    ("nemotronh-dense", "tiny", 0, {"n_groups": 4}, 0),            # Mamba2, attention, MLP
    ("nemotronh-moe", "tiny-moe", 0, {"n_groups": 4}, 0),          # Mamba2, MoE, attention
    # MTP attention + MoE, in a vocabulary where drafts are sometimes accepted
    ("nemotronh-mtp", "tiny", 1, {"n_groups": 4, "vocab_size": 8}, 2),
    ("qwen3.5", "qwen3.5-tiny", 0, {"linear_num_key_heads": 4}, 0),  # Gated DeltaNet, gated attention, gated MLP
    ("qwen3.5-mtp", "qwen3.5-tiny", 1, {"linear_num_key_heads": 4, "vocab_size": 8}, 2),
    # MQA (the one KV head replicated on every rank) and a vocabulary that splits evenly on no TP size
    ("mqa-odd-vocab", "tiny", 0, {"n_groups": 4, "num_key_value_heads": 1, "vocab_size": 509}, 0),
    # Biases (random: `_randomize_biases`) on every projection, row-parallel ones added once; a latent MoE; the
    # lm_head tied to the vocab-parallel embeddings
    ("biased-latent-tied", "tiny", 0, {"hybrid_override_pattern": "M*-E", "n_groups": 4, "mlp_bias": True,
                                       "use_bias": True, "moe_latent_size": 32, "tie_word_embeddings": True}, 0),
    # FP8 weights: block scales cut with their shards (MoE MTP block included), and per-tensor scales replicated
    ("nemotronh-fp8-block-mtp", "tiny-moe", 1, {"n_groups": 4, "vocab_size": 8}, 2, (16, 16)),
    ("qwen3.5-fp8-mtp", "qwen3.5-tiny", 1, {"linear_num_key_heads": 4, "vocab_size": 8}, 2, "fp8"),
]
ENGINE = dict(block_size=4, max_num_seqs=4, max_num_batched_tokens=64, long_prefill_token_threshold=8,
              num_kv_blocks=64)
PROMPT_LENGTHS = (5, 1, 19)


def _randomize_biases(path: Path) -> None:
    """The linear layers' biases, which a made model leaves at zero, drawn at random."""
    state = load_file(path)
    g = torch.Generator().manual_seed(1)
    for name, t in state.items():
        if name.endswith("proj.bias"):
            state[name] = torch.randn(t.shape, generator=g) * 0.1
    save_file(state, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The jobs, and their TP = 1 results."""
    root = tmp_path_factory.mktemp("tp-models")
    jobs = []
    for name, preset, mtp, overrides, k, *fp8 in MODELS:
        out = make_model(root / name, preset, mtp_layers=mtp, seed=3, overrides=overrides, progress=False,
                         tokenizer=False, quantize="fp8" if fp8 == ["fp8"] else None)
        if fp8 and fp8 != ["fp8"]:
            quantize_blockwise(out, fp8[0])
        if overrides.get("mlp_bias"):
            _randomize_biases(out / "model.safetensors")
        vocab = overrides.get("vocab_size", 512)
        g = torch.Generator().manual_seed(len(name))
        prompts = tuple(tuple(torch.randint(3, vocab, (n,), generator=g).tolist()) for n in PROMPT_LENGTHS)
        jobs.append(Job(name, str(out), prompts, 6, {**ENGINE, "num_speculative_tokens": k}))
    return jobs, run_single(jobs)


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def runs(request, reference, tmp_path_factory):
    """(TP = 1 results, per rank the TP results) of every job."""
    jobs, single = reference
    return single, run_ranks(jobs, request.param, tmp_path_factory.mktemp(f"tp{request.param}"))


def test_every_model_is_exact_and_every_rank_agrees(runs):
    single, ranks = runs
    for name, ref in single.items():
        got = ranks[0][name]
        assert got.tokens == ref.tokens, name
        assert (got.num_drafted, got.num_accepted) == (ref.num_drafted, ref.num_accepted), name
        torch.testing.assert_close(got.prefill_logits, ref.prefill_logits, rtol=1e-4, atol=1e-4, msg=name)
        for r, other in enumerate(ranks[1:], start=1):
            o = other[name]
            assert (o.tokens, o.num_drafted, o.num_accepted) == (got.tokens, got.num_drafted, got.num_accepted), \
                f"{name}: rank {r}"
    # The MTP jobs verified drafts, and some were accepted: the rejection sampler's decisions were exercised.
    mtp = [single[n] for n in single if n.endswith("-mtp")]
    assert all(sum(r.num_drafted) and sum(r.num_accepted) for r in mtp)


@pytest.mark.interpreter
def test_triton_kernels_on_two_ranks_equal_one(tmp_path):
    """The kernels the GPU runs (here in Triton's interpreter) over the shards' shapes: one layer of each NemotronH
    kind, MoE through the fused-MoE op, with MTP K=2."""
    out = make_model(tmp_path / "m", "tiny", mtp_layers=1, seed=3, progress=False, tokenizer=False,
                     overrides={"hybrid_override_pattern": "M*-E", "vocab_size": 8})
    jobs = [Job("triton", str(out), ((3, 5, 7, 2, 4), (6, 1, 2, 3, 7, 4, 5, 1, 2, 3, 6)), 4,
                {**ENGINE, "kernels": "triton", "num_speculative_tokens": 2})]
    ref, ranks = run_single(jobs)["triton"], run_ranks(jobs, 2, tmp_path / "ranks")
    for got in (r["triton"] for r in ranks):
        assert (got.tokens, got.num_drafted, got.num_accepted) == (ref.tokens, ref.num_drafted, ref.num_accepted)
        torch.testing.assert_close(got.prefill_logits, ref.prefill_logits, rtol=1e-4, atol=1e-4)


def _cfg(preset: str, **overrides) -> ModelConfig:
    return ModelConfig.from_hf_dict(build_config(preset, overrides=overrides))


@pytest.mark.parametrize("preset, overrides, tp, field", [
    ("tiny", {}, 3, "num_attention_heads"),
    ("tiny", {"num_attention_heads": 6, "num_key_value_heads": 3}, 2, "num_key_value_heads"),
    ("tiny", {}, 4, "n_groups"),
    ("tiny", {"mamba_num_heads": 6, "n_groups": 2, "num_attention_heads": 6, "num_key_value_heads": 6}, 4,
     "num_attention_heads"),
    ("tiny", {"n_groups": 4, "intermediate_size": 250}, 4, "intermediate_size"),
    ("tiny-moe", {"n_groups": 4, "moe_intermediate_size": 30}, 4, "moe_intermediate_size"),
    ("tiny-moe", {"moe_shared_expert_intermediate_size": 63}, 2, "moe_shared_expert_intermediate_size"),
    ("qwen3.5-tiny", {}, 4, "linear_num_key_heads"),
    ("qwen3.5-tiny", {"intermediate_size": 130}, 4, "linear_num_key_heads"),
    ("qwen3.5-tiny", {"intermediate_size": 129}, 2, "intermediate_size"),
])
def test_an_unsplittable_config_is_refused_naming_the_field(preset, overrides, tp, field):
    with pytest.raises(ValueError, match=f"config field '{field}': expected a multiple"):
        shard_config(_cfg(preset, **overrides), tp)


def _fp8_state(preset: str, block: tuple[int, int] | None, mtp: int = 0, **overrides
               ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    cfg = ModelConfig.from_hf_dict(build_config(preset, mtp, overrides=overrides))
    g = torch.Generator().manual_seed(0)
    state = {n: torch.randn(s, generator=g) for n, s in expected_weight_shapes(cfg).items()}
    qcfg = FP8Config(FP8 if block else "modelopt", block, "dynamic" if block else "static",
                     tuple(unquantized_linears({n: tuple(t.shape) for n, t in state.items()})))
    return quantize_state(cfg, state, qcfg, torch.float32)


@pytest.mark.parametrize("preset, block, tp, overrides", [
    ("tiny", (16, 16), 2, {"n_groups": 4}),
    ("tiny", (16, 16), 4, {"n_groups": 4}),   # KV heads replicated: a rank's head is a whole block
    ("tiny", (8, 16), 4, {"n_groups": 4, "num_key_value_heads": 1}),
    ("tiny-moe", (16, 16), 2, {}),            # FP8 routed-expert stacks: [E, row blocks, column blocks] scales cut
    ("tiny-moe", (8, 16), 4, {"n_groups": 4}),
    ("tiny-moe", None, 2, {}),                # an expert stack's [E] scales, replicated
    ("tiny", (128, 128), 2, {"n_groups": 4, "hybrid_override_pattern": "*-"}),  # inside one partial block
    ("qwen3.5-tiny", (16, 16), 2, {}),        # in_proj_a/b: a rank's few rows share their checkpoint block
    ("qwen3.5-tiny", (8, 8), 4, {"linear_num_key_heads": 4}),
    ("tiny", None, 4, {"n_groups": 4}),       # per-tensor scales, replicated
    ("qwen3.5-tiny", None, 2, {}),
])
def test_fp8_shards_dequantize_to_the_shards_of_the_dequantized_model(preset, block, tp, overrides):
    """Each rank's FP8 weights and scales (block scales cut with their rows or columns) are its shard of the 16-bit
    model the checkpoint dequantizes to, exactly, MTP layers included."""
    _check_fp8_shards(*_fp8_state(preset, block, mtp=1, **overrides), block, tp)


@pytest.mark.parametrize("inter, block", [(8, (16, 16)), (24, (4, 4)), (24, (8, 4)), (24, None)])
def test_fp8_qwen_moe_gated_stacks_shard_with_each_segments_scales(inter, block):
    """Qwen3.5-MoE's gated expert stacks (no preset has them) on two ranks: the checkpoint's up rows start a block grid
    of their own (I = 8 in 16 x 16 blocks: each segment one partial block, the up rows' scales not the gate's; I = 24
    in 4 x 4: whole blocks; 8 x 4: refused, rank 1's first block of gate rows would take rows of two checkpoint
    blocks)."""
    tp = 2
    d = {**qwen3_5_config("qwen3.5-tiny", {}), "model_type": "qwen3_5_moe_text", "num_experts": 4,
         "num_experts_per_tok": 2, "moe_intermediate_size": inter, "shared_expert_intermediate_size": 64}
    cfg = ModelConfig.from_hf_dict(d)
    g = torch.Generator().manual_seed(0)
    state = {n: torch.randn(s, generator=g) for n, s in expected_weight_shapes(cfg).items()}
    qcfg = FP8Config(FP8 if block else "modelopt", block, "dynamic" if block else "static",
                     tuple(unquantized_linears({n: tuple(t.shape) for n, t in state.items()})))
    cfg, state = quantize_state(cfg, state, qcfg, torch.float32)
    assert state["model.layers.0.mlp.experts.gate_up_proj"].dtype == FP8_DTYPE
    if block == (8, 4):
        with pytest.raises(ValueError, match=r"block-scaled FP8 'model\.layers\.0\.mlp\.experts\.gate_up_proj': "
                                             r"expected each 8 rows"):
            shard_state_dict(cfg, state, 1, tp)
        return
    _check_fp8_shards(cfg, state, block, tp)


def _check_fp8_shards(cfg: ModelConfig, state: dict[str, torch.Tensor], block: tuple[int, int] | None,
                      tp: int) -> None:
    assert any(t.dtype == FP8_DTYPE for t in state.values())
    whole = dequantize_state(state, torch.float32)
    local = shard_config(cfg, tp)
    for rank in range(tp):
        got = shard_state_dict(cfg, state, rank, tp)
        for name, t in shard_state_dict(cfg, whole, rank, tp).items():
            w = got[name]
            if w.dtype == FP8_DTYPE and w.dim() == 3:  # an expert stack (a gated one in two segments)
                parts = 2 if name.endswith("gate_up_proj") else 1
                scale = got.get(f"{name}_scale_inv", got.get(f"{name}_scale"))
                assert scale.shape == expert_scale_shape(tuple(w.shape), block, parts), name
                w = dequantize_experts(w, scale, block, parts)
            elif w.dtype == FP8_DTYPE:
                module = name[:-len(".weight")]
                scale = got.get(f"{module}.weight_scale_inv", got.get(f"{module}.weight_scale"))
                assert block is None or scale.shape == (-(-w.shape[0] // block[0]), -(-w.shape[1] // block[1]))
                w = dequantize(w, scale, block)
            assert torch.equal(w, t), (name, rank)
        assert set(expected_weight_shapes(local)) <= set(got)


def test_fp8_block_split_inside_a_checkpoint_block_is_refused_naming_the_weight():
    # Four ranks' 16 B rows then 16 C rows of Mamba's in_proj make one 32-row block of two checkpoint blocks.
    cfg, state = _fp8_state("tiny", (32, 32), n_groups=4)
    shard_state_dict(cfg, state, 1, 2)
    with pytest.raises(ValueError, match=r"block-scaled FP8 'model\.layers\.0\.mixer\.in_proj\.weight': expected "
                                         r"each 32 rows of a rank's shard to lie in one checkpoint block"):
        shard_state_dict(cfg, state, 1, 4)


def test_engine_and_parallel_fields_are_validated(reference, monkeypatch):
    with pytest.raises(ValueError, match="'tensor_parallel_size': expected a positive integer"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="'rank': expected an integer in 0..1"):
        ParallelConfig(2, 2)
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="'RANK': expected this process's rank 0..1"):
        TPGroup.from_env(2, torch.device("cpu"))
    cfg, weights = load_checkpoint(reference[0][0].model_dir)
    with pytest.raises(ValueError, match="'tensor_parallel_size': expected the group's size 1, got 2"):
        LLMEngine(cfg, weights, EngineConfig(tensor_parallel_size=2, device="cpu"), tp=TPGroup.single())


def test_vocab_rows_pad_the_last_rank():
    t = torch.arange(5 * 2.0).view(5, 2)
    parts = [shard_rows(t, r, 2) for r in range(2)]
    assert per_rank(5, 2) == 3 and all(p.shape == (3, 2) for p in parts)
    assert torch.equal(torch.cat(parts)[:5], t) and not parts[1][2].any()


def test_qwen_moe_shards_sum_to_the_whole_block():
    """The Qwen3.5 sparse MoE (not in a preset): each rank's share of every expert and of the shared expert (gate
    rows and up rows split alike) sums to the block's output, the all-reduce's input."""
    base = _cfg("qwen3.5-tiny")
    cfg = ModelConfig(**{**{f: getattr(base, f) for f in base.__dataclass_fields__ if f != "raw"},
                         "layer_types": tuple("E" if t == "-" else t for t in base.layer_types), "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                         "moe_shared_expert_intermediate_size": 48})
    kernels = resolve_kernels("torch", torch.device("cpu"))
    g = torch.Generator().manual_seed(0)

    def block(c: ModelConfig, state: dict[str, torch.Tensor]) -> QwenSparseMoE:
        m = QwenSparseMoE(c)
        m.load_state_dict({k.split(".mlp.", 1)[1]: v for k, v in state.items()})
        bind_kernels(m, kernels)
        return m

    full = {f"model.layers.0.mlp.{k}": torch.randn(v.shape, generator=g) * 0.2
            for k, v in QwenSparseMoE(cfg).state_dict().items()}
    x = torch.randn(6, cfg.hidden_size, generator=g)
    want = block(cfg, full)(x)
    got = sum(block(shard_config(cfg, 2), shard_state_dict(cfg, full, r, 2))(x) for r in range(2))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
