"""FP8 routed experts in a model: a checkpoint's FP8 expert weights load as float8_e4m3fn stacks with their scales
stacked beside them (NemotronH per-tensor and block-wise, the latter at 128 x 128, one partial block of the tiny
shapes, and at 16 x 16, several blocks per expert; Qwen3.5-MoE's gated stacks, each expert's gate and up rows with
their own scales), take half the bytes of the 16-bit stacks, and give the dequantized-at-load model's logits and
greedy tokens: NemotronH's bit for bit on the torch reference path, within fp32 rounding through the fused-MoE
kernels (Triton's interpreter here) and for Qwen3.5 (whose dequantized model fuses projections the FP8 one runs
apart)."""

from __future__ import annotations

import dataclasses
import json

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
from baton.engine.layers.fp8_experts import ExpertStacks
from baton.engine.llm_engine import LLMEngine
from baton.engine.loader import load_checkpoint
from baton.engine.make_model import init_tensor, make_model
from baton.engine.make_model_qwen3_5 import qwen3_5_config
from baton.engine.ops.fp8_linear.reference import FP8_DTYPE
from baton.engine.quant_config import FP8, MODELOPT, FP8Config
from baton.engine.sampling_params import SamplingParams
from baton.engine.weights import expected_weight_shapes
from tests.fp8_rewrite import quantize_blockwise

PROMPTS = [list(range(5, 30)), [7, 3, 9]]
MAX_TOKENS = 5


def _engine(cfg: ModelConfig, state: dict[str, torch.Tensor], kernels: str) -> LLMEngine:
    ecfg = EngineConfig(device="cpu", dtype="float32", max_num_seqs=2, max_num_batched_tokens=64, block_size=16,
                        num_kv_blocks=16, max_model_len=64, kernels=kernels)
    return LLMEngine(cfg, dict(state), ecfg)


def _run(cfg, state, kernels) -> tuple[torch.Tensor, list[list[int]], list[ExpertStacks]]:
    """(prefill logits of the first prompt, greedy tokens of every prompt, the model's expert modules)."""
    engine = _engine(cfg, state, kernels)
    rid = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=1))
    with torch.inference_mode():
        hidden, _ = engine.runner.forward_hidden(engine.scheduler.schedule())
        logits = engine.model.logits(hidden)
    engine.abort(rid)
    outs = engine.generate([list(p) for p in PROMPTS], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    experts = [m for m in engine.model.modules() if isinstance(m, ExpertStacks)]
    return logits, [list(o.token_ids) for o in outs], experts


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory):
    """tiny-moe with an MoE MTP block: 16-bit, per tensor, block-wise 128 x 128 and 16 x 16."""
    root = tmp_path_factory.mktemp("fp8-experts")
    out = {q: make_model(root / str(q), "tiny-moe", mtp_layers=1, progress=False, tokenizer=False, quantize=q)
           for q in (None, "fp8", "fp8-block")}
    out["fp8-block16"] = make_model(root / "b16", "tiny-moe", mtp_layers=1, progress=False, tokenizer=False)
    quantize_blockwise(out["fp8-block16"], (16, 16))
    return out


FORMATS = [("fp8", None), ("fp8-block", (128, 128)), ("fp8-block16", (16, 16))]


@pytest.mark.parametrize(("fmt", "block"), FORMATS, ids=[f for f, _ in FORMATS])
def test_nemotron_experts_load_as_fp8_stacks(nemotron, fmt, block):
    cfg, state = load_checkpoint(nemotron[fmt])
    _, state16 = load_checkpoint(nemotron[None])
    e, inter, hidden = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    for layer in ("model.layers.1", "mtp.layers.1"):
        up, down = f"{layer}.mixer.experts.up_proj", f"{layer}.mixer.experts.down_proj"
        assert state[up].dtype == FP8_DTYPE and state[down].dtype == FP8_DTYPE
        assert state[up].shape == (e, inter, hidden) and state[down].shape == (e, hidden, inter)
        if block is None:
            assert state[f"{up}_scale"].shape == (e,) and f"{up}_scale_inv" not in state
        else:
            assert state[f"{up}_scale_inv"].shape == (e, -(-inter // block[0]), -(-hidden // block[1]))
            assert state[f"{down}_scale_inv"].shape == (e, -(-hidden // block[0]), -(-inter // block[1]))
        assert state[up].nbytes * state16[up].element_size() == state16[up].nbytes
    assert not any(".experts." in n and n.endswith("input_scale") for n in state)


# Every format on the torch references; the fused-MoE kernels (interpreted: slow) on NemotronH's format of several
# blocks per expert, since `test_ops_triton_moe_fp8.py` holds both scale kinds against the reference op by op.
TRITON = pytest.mark.interpreter


@pytest.mark.parametrize(("fmt", "block", "kernels"), [
    *[(f, b, "torch") for f, b in FORMATS], pytest.param("fp8-block16", (16, 16), "triton", marks=TRITON)],
    ids=[*[f"{f}-torch" for f, _ in FORMATS], "fp8-block16-triton"])
def test_nemotron_fp8_experts_equal_the_dequantized_model(nemotron, fmt, block, kernels):
    cfg, state = load_checkpoint(nemotron[fmt])
    got, tokens, experts = _run(cfg, state, kernels)
    # the engine's experts (body and MTP block) hold e4m3 stacks: a quarter of the fp32 model's expert bytes
    assert len(experts) == cfg.layer_types.count("E")  # the body's MoE layers (the drafter is not in engine.model)
    for m in experts:
        assert m.up_proj.dtype == FP8_DTYPE and m.down_proj.dtype == FP8_DTYPE and m.block == block
        assert m.scale("up_proj").dtype == torch.float32
    fp8_bytes = sum(p.nbytes for m in experts for p in m.parameters())
    want, want_tokens, experts16 = _run(dataclasses.replace(cfg, quantization=None),
                                        dequantize_state(state, torch.float32), kernels)
    assert all(m.up_proj.dtype == torch.float32 and m.scale("up_proj") is None for m in experts16)
    assert fp8_bytes < 0.3 * sum(p.nbytes for m in experts16 for p in m.parameters())
    if kernels == "torch":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    assert tokens == want_tokens


def test_modelopt_expert_input_scales_are_dropped(nemotron, tmp_path):
    """A ModelOpt checkpoint's static per-expert input scales: accepted, and dropped (weight-only experts)."""
    out = tmp_path / "m"
    out.mkdir()
    for f in ("config.json", "model.safetensors"):
        (out / f).write_bytes((nemotron["fp8"] / f).read_bytes())
    tensors = load_file(str(out / "model.safetensors"))
    for j in range(8):
        tensors[f"model.layers.1.mixer.experts.{j}.up_proj.input_scale"] = torch.tensor(0.02)
    save_file(tensors, str(out / "model.safetensors"))
    cfg, state = load_checkpoint(out)
    assert "model.layers.1.mixer.experts.up_proj_input_scale" not in state
    assert not any("input_scale" in n for n in state)
    got, _, _ = _run(cfg, state, "torch")
    want, _, _ = _run(*load_checkpoint(nemotron["fp8"]), "torch")
    assert torch.equal(got, want)


def test_an_expert_stack_of_mixed_dtypes_is_refused(nemotron, tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    for f in ("config.json", "model.safetensors"):
        (out / f).write_bytes((nemotron["fp8"] / f).read_bytes())
    tensors = load_file(str(out / "model.safetensors"))
    name = "model.layers.1.mixer.experts.3.up_proj"
    tensors[f"{name}.weight"] = tensors[f"{name}.weight"].float() * tensors.pop(f"{name}.weight_scale")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["ignore"].append(name)
    (out / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match=r"per-expert weights of 'model\.layers\.1\.mixer\.experts\.up_proj': expected "
                                         r"one dtype for all experts"):
        load_checkpoint(out)


def _qwen_moe(block: tuple[int, int] | None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A tiny Qwen3.5-MoE (no preset has one): every MLP a sparse MoE of 8 gated experts, I = 24 (16 x 16 blocks: each
    segment's last row block partial), quantized in memory as `make-model --quantize` writes a checkpoint."""
    d = {**qwen3_5_config("qwen3.5-tiny", {}), "model_type": "qwen3_5_moe_text", "num_experts": 8,
         "num_experts_per_tok": 2, "moe_intermediate_size": 24, "shared_expert_intermediate_size": 48}
    cfg = ModelConfig.from_hf_dict(d)
    shapes = expected_weight_shapes(cfg)
    state = {n: init_tensor(n, s, cfg, d, 0) for n, s in shapes.items()}
    qcfg = FP8Config(MODELOPT, None, "static") if block is None else FP8Config(FP8, block, "dynamic")
    qcfg = dataclasses.replace(qcfg, ignore=tuple(unquantized_linears(shapes)))
    return quantize_state(cfg, state, qcfg, torch.float32)


@pytest.mark.parametrize("block", [None, (16, 16)], ids=["per-tensor", "block16"])
def test_qwen_moe_fp8_experts_equal_the_dequantized_model(block):
    """On the torch references (the gated stacks' two scale grids run through the kernels in
    `test_ops_triton_moe_fp8.py`)."""
    cfg, state = _qwen_moe(block)
    gate_up = "model.layers.0.mlp.experts.gate_up_proj"
    assert state[gate_up].dtype == FP8_DTYPE and state[gate_up].shape == (8, 48, 64)
    if block is None:  # each expert's gate and up scales apart
        assert state[f"{gate_up}_scale"].shape == (8, 2)
    else:  # each segment's 2 row blocks (24 rows), 4 column blocks
        assert state[f"{gate_up}_scale_inv"].shape == (8, 4, 4)
    got, tokens, experts = _run(cfg, state, "torch")
    assert experts and all(m.gate_up_proj.dtype == FP8_DTYPE for m in experts)
    want, want_tokens, _ = _run(dataclasses.replace(cfg, quantization=None), dequantize_state(state, torch.float32),
                                "torch")
    # The dequantized model fuses the input projections that read one input into one GEMM, the FP8 one runs them
    # apart (each has its own scales): equal to fp32 rounding, not bit for bit (as `test_fp8_checkpoint.py` says)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert tokens == want_tokens
