"""`--kv-cache-dtype fp8` in the engine: the pool's dtype and size, logits and greedy tokens against the model
dtype's, the drafter's KV, checkpoint scales, the transfer compatibility check and the flag."""

import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from baton.engine.engine_config import EngineConfig
from baton.engine.kv_cache_dtype import resolve_kv_dtype
from baton.engine.llm_engine import LLMEngine
from baton.engine.loader import load_checkpoint
from baton.engine.make_model import make_model
from baton.engine.sampling_params import SamplingParams
from baton.node.engine_args import engine_config_from_args, parse_engine_flags
from baton.transfer.errors import IncompatiblePeer
from baton.transfer.metadata import check_compatible
from tests.test_side_channel import metadata

FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-mtp")
    make_model(out, preset="tiny", seed=3, progress=False, mtp_layers=1)
    return out


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_checkpoint(tiny_dir)


def engine(model, **kw):
    cfg, weights = model
    return LLMEngine(cfg, dict(weights), EngineConfig(**{"max_num_seqs": 8, "max_num_batched_tokens": 64,
                                                         "block_size": 8, **kw}))


def prefill_logits(e, prompt):
    e.add_request(prompt, SamplingParams(max_tokens=1))
    with torch.inference_mode():
        ids, batch = e.runner.build_batch(e.scheduler.schedule())
        return e.model.logits(e.model(ids, batch))


def test_fp8_pool_takes_half_the_bytes_and_twice_the_blocks(tiny):
    budget = 4 * 2**20
    b16 = engine(tiny, dtype="bfloat16", cache_memory_bytes=budget)
    f8 = engine(tiny, dtype="bfloat16", cache_memory_bytes=budget, kv_cache_dtype="fp8")
    assert b16.pools.kv.dtype == torch.bfloat16 and f8.pools.kv.dtype == FP8 and f8.pools.kv.element_size() == 1
    assert f8.plan.block_bytes * 2 == b16.plan.block_bytes
    # The state slots take the same share of both budgets; the rest holds twice the blocks (+- the scratch one).
    assert abs(f8.plan.num_blocks - 2 * b16.plan.num_blocks) <= 2
    assert f8.kv_scales is not None and torch.equal(f8.kv_scales.cpu(), torch.ones(2, 2))
    assert b16.kv_scales is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_logits_stay_within_e4m3_precision(tiny, dtype):
    """Measured on this model: the largest logit moves by about 2% of the largest logit, and 95-98% of the
    positions keep their argmax. Bounded at 2**-4 (e4m3's relative rounding) of the largest logit and 90%; an
    engine that ignored the scales or misread the FP8 bytes is far outside both."""
    rng = random.Random(0)
    prompt = [rng.randrange(3, 512) for _ in range(40)]
    ref = prefill_logits(engine(tiny, dtype=dtype), prompt)
    got = prefill_logits(engine(tiny, dtype=dtype, kv_cache_dtype="fp8"), prompt)
    err = (got - ref).abs().max().item()
    assert 0 < err <= 2.0**-4 * ref.abs().max().item()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_fp8_greedy_tokens_mostly_agree_and_the_drafter_reads_fp8_too(tiny):
    """Measured: 113 of 128 greedy tokens (7 of 8 requests whole) equal the fp32 cache's; bounded at 80%. With MTP
    the drafter's KV is FP8 in the same blocks and verification keeps greedy output exactly the FP8 engine's."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 30, 17, 9, 40, 1, 2, 3)]
    p = SamplingParams(max_tokens=16, ignore_eos=True)
    ref = [o.token_ids for o in engine(tiny).generate(prompts, p)]
    got = [o.token_ids for o in engine(tiny, kv_cache_dtype="fp8").generate(prompts, p)]
    same = sum(a == b for r, g in zip(ref, got, strict=True) for a, b in zip(r, g, strict=True))
    assert same >= 0.8 * sum(map(len, ref))
    spec = engine(tiny, kv_cache_dtype="fp8", num_speculative_tokens=2)
    assert spec.plan.num_mtp_kv_layers == 1 and spec.pools.mtp_kv_layers()[0].dtype == FP8
    drafter = [m for m in spec.mtp.modules() if hasattr(m, "kv_index")]
    assert drafter and all(m.kv_scale is not None for m in drafter)
    assert [o.token_ids for o in spec.generate(prompts, p)] == got


def _with_scales(tiny_dir, tmp_path, scales):
    out = tmp_path / "scaled"
    out.mkdir()
    for f in tiny_dir.iterdir():
        if f.is_file():
            (out / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(out / "model.safetensors"))
    tensors.update({k: torch.tensor(v) for k, v in scales.items()})
    save_file(tensors, str(out / "model.safetensors"))
    return load_checkpoint(out)


def test_checkpoint_scales_are_used(tiny_dir, tiny, tmp_path):
    """ModelOpt's names (on the k/v projections, legacy `backbone.` prefix) and vLLM's (`.attn`), for a target
    layer and the drafter's; the cache then holds K / k_scale, and the logits stay close."""
    model = _with_scales(tiny_dir, tmp_path, {"backbone.layers.1.mixer.k_proj.k_scale": 0.02,
                                              "backbone.layers.1.mixer.v_proj.v_scale": 0.05,
                                              "model.layers.6.mixer.attn.k_scale": 0.03,
                                              "mtp.layers.0.mixer.k_proj.k_scale": 0.04})
    e = engine(model, kv_cache_dtype="fp8", num_speculative_tokens=1)
    assert torch.allclose(e.kv_scales.cpu(), torch.tensor([[0.02, 0.05], [0.03, 1.0], [0.04, 1.0]]))
    rng = random.Random(1)
    prompt = [rng.randrange(3, 512) for _ in range(24)]
    ref = prefill_logits(engine(tiny), prompt)
    got = prefill_logits(e, prompt)
    assert (got - ref).abs().max() <= 2.0**-4 * ref.abs().max()
    # A 16-bit cache ignores them.
    assert engine(model).kv_scales is None


def test_a_scale_of_no_attention_layer_is_refused(tiny_dir, tmp_path):
    model = _with_scales(tiny_dir, tmp_path, {"model.layers.0.mixer.k_scale": 0.02})  # layer 0 is Mamba
    with pytest.raises(ValueError, match="KV-cache scale 'model.layers.0.mixer.k_scale' expected on an attention"):
        engine(model, kv_cache_dtype="fp8")


def test_fp8_and_16_bit_peers_are_incompatible_naming_the_kv_dtype():
    check_compatible(metadata("d0", kv_dtype=FP8), metadata("p0", kv_dtype=FP8))
    with pytest.raises(IncompatiblePeer, match="'kv_dtype'") as e:
        check_compatible(metadata("d0", kv_dtype=FP8), metadata("p0"))
    assert e.value.field == "kv_dtype"


def test_flag_parses_and_bad_values_are_refused():
    a = parse_engine_flags(["--kv-cache-dtype", "fp8"], "--engine-args")
    assert engine_config_from_args(a).kv_cache_dtype == "fp8"
    assert engine_config_from_args(parse_engine_flags([], "--engine-args")).kv_cache_dtype == "auto"
    with pytest.raises(ValueError, match="kv-cache-dtype"):
        parse_engine_flags(["--kv-cache-dtype", "int8"], "--engine-args")
    with pytest.raises(ValueError, match="engine field 'kv_cache_dtype': expected one of auto, fp8, got 'fp8_e5m2'"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")


def test_devices_without_fp8_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="engine field 'kv_cache_dtype': expected 'auto' on a meta device"):
        resolve_kv_dtype("fp8", torch.bfloat16, torch.device("meta"), False)
    # An Ampere GPU's Triton has no float8_e4m3fn conversion (no GPU here: its capability is what is asked).
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match="expected 'auto' on NVIDIA A100 \\(compute capability 8.0"):
        resolve_kv_dtype("fp8", torch.bfloat16, torch.device("cuda"), True)
    assert resolve_kv_dtype("auto", torch.bfloat16, torch.device("cuda"), True) == torch.bfloat16


def test_qwen3_5_gated_attention_with_fp8_kv(tmp_path):
    """Qwen3.5's gated attention (RoPE'd keys) and its MTP layer over an FP8 pool. Measured: all 48 greedy tokens
    equal the fp32 cache's; bounded at 80%, and MTP keeps the FP8 engine's tokens exactly."""
    model = load_checkpoint(make_model(tmp_path / "q", "qwen3.5-tiny", seed=3, progress=False, mtp_layers=1))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 30, 17, 9)]
    p = SamplingParams(max_tokens=12, ignore_eos=True)
    ref = [o.token_ids for o in engine(model, max_num_seqs=4).generate(prompts, p)]
    e = engine(model, max_num_seqs=4, kv_cache_dtype="fp8")
    assert e.pools.kv.dtype == FP8
    got = [o.token_ids for o in e.generate(prompts, p)]
    assert sum(a == b for r, g in zip(ref, got, strict=True) for a, b in zip(r, g, strict=True)) >= 0.8 * 48
    spec = engine(model, max_num_seqs=4, kv_cache_dtype="fp8", num_speculative_tokens=2)
    assert [o.token_ids for o in spec.generate(prompts, p)] == got
