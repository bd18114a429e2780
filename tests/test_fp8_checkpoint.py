"""FP8 checkpoints: `quantization_config` parsing, loading both formats (as written by `make_model --quantize` and
in the layout of real ModelOpt checkpoints), and the engine's logits against the dequantized and unquantized
models."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from baton.engine.engine_config import EngineConfig
from baton.engine.fp8_checkpoint import dequantize_state, quantize_state
from baton.engine.layers.fp8_linear import FP8Linear
from baton.engine.llm_engine import LLMEngine
from baton.engine.loader import load_checkpoint
from baton.engine.make_model import make_model
from baton.engine.ops.fp8_linear.reference import FP8_DTYPE
from baton.engine.quant_config import FP8Config, parse_quantization_config, read_quant_config
from baton.engine.sampling_params import SamplingParams

SEQ = list(range(5, 45))


def prefill_logits(cfg, weights, seq=SEQ, fused_gemv=False):
    """The engine's fp32 logits [len(seq), vocab] of one prefill of `seq`, and its FP8 layers; `fused_gemv`: the
    step runs the few-token path (norms fused into the GEMVs, `ForwardBatch.fused_gemv`)."""
    n, bs = len(seq), 16
    ecfg = EngineConfig(device="cpu", dtype="float32", max_num_seqs=1, max_num_batched_tokens=n, block_size=bs,
                        num_kv_blocks=-(-n // bs) + 4, max_model_len=n + 8)
    engine = LLMEngine(cfg, dict(weights), ecfg)
    engine.add_request(seq, SamplingParams(max_tokens=1))
    out = engine.scheduler.schedule()
    with torch.inference_mode():
        ids, batch = engine.runner.build_batch(out)
        batch.fused_gemv = fused_gemv
        logits = engine.model.logits(engine.model(ids, batch))
    return logits, [m for m in engine.model.modules() if isinstance(m, FP8Linear)]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    return {q: make_model(root / str(q), "tiny-moe", mtp_layers=1, progress=False, tokenizer=False, quantize=q)
            for q in (None, "fp8", "fp8-block")}


# ---- quantization_config ----------------------------------------------------------------------------------------

def test_parses_both_formats():
    mo = parse_quantization_config({"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
                                    "ignore": ["lm_head", "model.layers.*.self_attn*"]})
    assert mo == FP8Config("modelopt", None, "static", ("lm_head", "model.layers.*.self_attn*"), "FP8")
    assert mo.scale_name == "weight_scale" and mo.is_ignored("model.layers.3.self_attn.q_proj")
    assert mo.is_ignored("lm_head") and not mo.is_ignored("model.layers.3.mlp.up_proj")
    blk = parse_quantization_config({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128], "modules_to_not_convert": ["model.layers.0.mlp"]})
    assert blk.block_size == (128, 128) and blk.scale_name == "weight_scale_inv"
    assert blk.is_ignored("model.layers.0.mlp.gate_proj")
    assert parse_quantization_config(blk.to_hf_dict()) == blk
    assert parse_quantization_config(mo.to_hf_dict()) == mo
    assert parse_quantization_config(None) is None


@pytest.mark.parametrize(("d", "field"), [
    ({"quant_method": "awq"}, "quant_method"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "quant_algo"),
    ({"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "INT8"}, "kv_cache_quant_algo"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, "activation_scheme"),
    ({"quant_method": "fp8", "modules_to_not_convert": "lm_head"}, "modules_to_not_convert"),
])
def test_unsupported_quantization_is_refused_naming_the_field(d, field):
    with pytest.raises(ValueError, match=f"'{field}': expected .*, got"):
        parse_quantization_config(d)


def test_modelopt_sidecar_file(tmp_path):
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8", "exclude_modules": ["lm_head"]}}))
    assert read_quant_config(tmp_path, {}) == FP8Config("modelopt", None, "static", ("lm_head",))


# ---- loading and running ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("quantize", ["fp8", "fp8-block"])
def test_written_checkpoint_loads_fp8_and_equals_the_dequantized_model(written, quantize):
    cfg, state = load_checkpoint(written[quantize])
    scale = "weight_scale" if quantize == "fp8" else "weight_scale_inv"
    assert cfg.quantization.scale_name == scale
    assert state["model.layers.0.mixer.in_proj.weight"].dtype == FP8_DTYPE
    assert state[f"model.layers.3.mixer.q_proj.{scale}"].dtype == torch.float32
    assert state["model.layers.1.mixer.gate.weight"].dtype == torch.float32  # the router: never FP8
    # the routed experts stay FP8 stacks with their scales stacked beside them; the shared expert is an FP8 Linear
    assert state["model.layers.1.mixer.experts.up_proj"].dtype == FP8_DTYPE
    assert state[f"model.layers.1.mixer.experts.up_proj{scale[len('weight'):]}"].dtype == torch.float32
    assert state["model.layers.1.mixer.shared_experts.up_proj.weight"].dtype == FP8_DTYPE
    got, fp8_layers = prefill_logits(cfg, state)
    assert len(fp8_layers) == sum(v.dtype == FP8_DTYPE and v.dim() == 2 for k, v in state.items()
                                  if not k.startswith("mtp."))
    want, none = prefill_logits(dataclasses.replace(cfg, quantization=None), dequantize_state(state, torch.float32))
    assert not none and torch.equal(got, want)
    cfg0, state0 = load_checkpoint(written[None])  # and the in-memory quantizer makes the same tensors
    _, mem = quantize_state(cfg0, state0, cfg.quantization, torch.float32)
    assert mem.keys() == state.keys() and all(torch.equal(mem[k].float(), state[k].float()) for k in state)


@pytest.mark.parametrize("quantize", ["fp8", "fp8-block"])
def test_fp8_layers_take_the_fused_gemv_and_equal_the_dequantized_model(written, quantize):
    """Few-token steps read the FP8 weights with the GEMV op (the reference op here: dequantize, then the product),
    with the block's norm and relu2 fused in front, as the dequantized model's 16-bit layers."""
    from baton.engine.layers.gemv_weight import gemv_weight
    from baton.engine.ops.kernels import resolve_kernels

    cfg, state = load_checkpoint(written[quantize])
    got, fp8_layers = prefill_logits(cfg, state, fused_gemv=True)
    assert fp8_layers and all(gemv_weight(m, resolve_kernels("torch", "cpu")) is not None for m in fp8_layers)
    want, _ = prefill_logits(dataclasses.replace(cfg, quantization=None), dequantize_state(state, torch.float32),
                             fused_gemv=True)
    assert torch.equal(got, want)
    plain, _ = prefill_logits(cfg, state)  # the separate norm, then the layer's own forward
    assert (got - plain).abs().max() <= 1e-4 * plain.abs().max()


def test_fp8_logits_stay_near_the_unquantized_model(tmp_path):
    """tiny (no MoE in the body): e4m3's 3 mantissa bits cost the random model's logits a few percent. (With MoE
    layers a random model's near-uniform router flips experts, which moves its logits more.)"""
    cfg, state = load_checkpoint(make_model(tmp_path / "t", "tiny", progress=False, tokenizer=False))
    ref, _ = prefill_logits(cfg, state)
    for qcfg in (FP8Config("modelopt", None, "static"), FP8Config("fp8", (128, 128), "dynamic")):
        got, _ = prefill_logits(*quantize_state(cfg, state, qcfg, torch.float32))
        assert (got - ref).abs().max() < 0.1 * ref.abs().max()
        assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_modelopt_layout_with_legacy_names_and_static_input_scales(written, tmp_path):
    """The layout of NVIDIA's FP8 Nemotron checkpoints: `backbone.` names, per-expert tensors with their own scales,
    static `input_scale`s, FP8 KV-cache scales, the quantization in `hf_quant_config.json`."""
    out = tmp_path / "modelopt"
    shutil.copytree(written["fp8"], out)
    tensors = load_file(str(out / "model.safetensors"))
    renamed = {("backbone." + k[len("model."):] if k.startswith("model.") else k): v for k, v in tensors.items()}
    renamed["backbone.layers.0.mixer.in_proj.input_scale"] = torch.tensor(0.02)
    renamed["backbone.layers.1.mixer.experts.0.up_proj.input_scale"] = torch.tensor(0.02)
    renamed["backbone.layers.3.mixer.k_proj.k_scale"] = torch.tensor(1.0)
    save_file(renamed, str(out / "model.safetensors"))
    d = json.loads((out / "config.json").read_text())
    q = d.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(d))
    (out / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
                                                             "exclude_modules": q["ignore"]}}))
    cfg, state = load_checkpoint(out)
    assert cfg.quantization.kv_cache_quant_algo == "FP8"
    assert state["model.layers.0.mixer.in_proj.input_scale"].shape == ()
    _, fp8_layers = prefill_logits(cfg, state)
    assert sum(m.input_scale is not None for m in fp8_layers) == 1


def _corrupt(written, tmp_path, edit):
    out = tmp_path / "bad"
    shutil.copytree(written["fp8"], out)
    tensors = load_file(str(out / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize(("edit", "match"), [
    (lambda t: t.pop("model.layers.0.mixer.in_proj.weight_scale"), "expected its scale"),
    (lambda t: t.__setitem__("model.layers.0.mixer.in_proj.weight_scale", torch.ones(3)), "expected shape"),
    (lambda t: t.__setitem__("model.layers.1.mixer.gate.weight_scale", torch.tensor(1.0)), "without a float8"),
    (lambda t: t.__setitem__("lm_head.weight", t["lm_head.weight"].to(FP8_DTYPE)), "ignore list"),
])
def test_inconsistent_fp8_tensors_are_refused(written, tmp_path, edit, match):
    with pytest.raises(ValueError, match=match):
        load_checkpoint(_corrupt(written, tmp_path, edit))


def test_fp8_weights_without_a_quantization_config_are_refused(written, tmp_path):
    out = tmp_path / "noconfig"
    shutil.copytree(written["fp8"], out)
    d = json.loads((out / "config.json").read_text())
    del d["quantization_config"]
    (out / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="expected a quantization_config"):
        load_checkpoint(out)


def test_qwen3_5_fp8_equals_its_dequantized_model(tmp_path):
    cfg, state = load_checkpoint(make_model(tmp_path / "q", "qwen3.5-tiny", progress=False, tokenizer=False,
                                            quantize="fp8"))
    assert any(v.dtype == FP8_DTYPE for v in state.values())
    got, fp8_layers = prefill_logits(cfg, state)
    want, _ = prefill_logits(dataclasses.replace(cfg, quantization=None), dequantize_state(state, torch.float32))
    # The dequantized model runs its input projections as one fused GEMM and the FP8 one as separate GEMMs (each
    # part has its own scales), so the sums round differently: equal to fp32 rounding, not bit for bit.
    assert fp8_layers and torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
