"""Canonical parameter names and shapes of a NemotronH checkpoint.

Canonical names are the ones HF transformers' `NemotronHForCausalLM` uses today (5.x):
`model.embeddings.weight`, `model.layers.{i}.norm.weight`, `model.layers.{i}.mixer.*`, `model.norm_f.weight`,
`lm_head.weight`, with the routed experts of an MoE layer fused into 3D tensors
`mixer.experts.up_proj` [E, moe_inter, in] and `mixer.experts.down_proj` [E, in, moe_inter].

The original NemotronH checkpoints use `backbone.` instead of `model.` and store one 2D tensor per expert
(`mixer.experts.{j}.up_proj.weight`); `canonicalize_names` rewrites both, as HF's
`conversion_mapping.py` ("nemotron_h": `WeightRenaming("backbone.", "model.")` plus
`MergeModulelist(dim=0)` of `mixer.experts.*.up_proj.weight` / `mixer.experts.*.down_proj.weight`) does. An FP8
checkpoint's per-expert scales are stacked alike, beside their stack (`mixer.experts.up_proj_scale` [E] from each
expert's `weight_scale`, `..._scale_inv` [E, row blocks, column blocks] from its `weight_scale_inv`).

MTP (multi-token prediction) weights. HF transformers does not load them (`_keys_to_ignore_on_load_unexpected
= [r"mtp.*"]`); their names come from the serving engines that do:
vllm-project/vllm `vllm/model_executor/models/nemotron_h_mtp.py`,
sgl-project/sglang `python/sglang/srt/models/nemotron_h_mtp.py` and
NVIDIA/TensorRT-LLM `tensorrt_llm/_torch/models/modeling_nemotron_h.py` (`NemotronHMTP`).
One MTP step is `len(mtp_hybrid_override_pattern)` decoder layers; the layers of all steps are numbered
flat, `mtp.layers.{step * len(pattern) + j}`, layer j having the block type `pattern[j]`. Every MTP layer
is a regular NemotronH block (`norm.weight`, `mixer.*`, same names as in `model.layers`); the first layer of
a step also has `enorm.weight`, `hnorm.weight` [hidden] and `eh_proj.weight` [hidden, 2 * hidden]
(no bias; applied to `cat([enorm(embed(t_{i+1})), hnorm(h_i)], -1)`), the last one `final_layernorm.weight`.
Embeddings and `lm_head` are shared with the target model.
E.g. num_nextn_predict_layers=1 and pattern "*E" give `mtp.layers.0` (attention + enorm/hnorm/eh_proj)
and `mtp.layers.1` (MoE + final_layernorm).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

import torch

from baton.engine.config import ATTENTION, MAMBA, MLP, MOE, ModelConfig
from baton.engine.layer_symbols import QWEN3_5
from baton.engine.weights_experts import STACK_SCALE_SUFFIXES, stack_experts, stack_suffix
from baton.engine.weights_qwen3_5 import canonicalize_qwen3_5, qwen3_5_weight_shapes

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# HF keeps the MoE router in fp32 whatever the model dtype (`_keep_in_fp32_modules_strict`).
FP32_SUFFIXES = ("mixer.gate.weight", "mixer.gate.e_score_correction_bias")
# An FP8 Linear's scales (`quant_config.py`), kept fp32 whatever the model dtype.
FP8_SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv", ".input_scale")
LEGACY_PREFIX, CANONICAL_PREFIX = "backbone.", "model."
MTP_PREFIX = "mtp."
# `...mixer.experts.{j}.up_proj.weight` (or its FP8 scale `.weight_scale` / `.weight_scale_inv`) -> groups (prefix,
# expert index, projection, leaf).
_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.mixer\.experts)\.(?P<expert>\d+)\.(?P<proj>up_proj|down_proj)"
                         r"\.(?P<leaf>weight|weight_scale|weight_scale_inv)$")


def _mixer_shapes(cfg: ModelConfig, symbol: str) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of one mixer, keyed by name relative to `...mixer.`."""
    h = cfg.hidden_size
    out: dict[str, tuple[int, ...]] = {}
    if symbol == MAMBA:
        inner, heads = cfg.mamba_intermediate_size, cfg.mamba_num_heads
        # in_proj packs [z (gate) | x, B, C (the conv input) | dt]
        out["in_proj.weight"] = (inner + cfg.conv_dim + heads, h)
        if cfg.mamba_proj_bias:
            out["in_proj.bias"] = (inner + cfg.conv_dim + heads,)
        out["conv1d.weight"] = (cfg.conv_dim, 1, cfg.conv_kernel)
        if cfg.use_conv_bias:
            out["conv1d.bias"] = (cfg.conv_dim,)
        out["dt_bias"] = (heads,)
        out["A_log"] = (heads,)
        out["D"] = (heads,)
        out["norm.weight"] = (inner,)
        out["out_proj.weight"] = (h, inner)
        if cfg.mamba_proj_bias:
            out["out_proj.bias"] = (h,)
    elif symbol == ATTENTION:
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        out["q_proj.weight"] = (q, h)
        out["k_proj.weight"] = (kv, h)
        out["v_proj.weight"] = (kv, h)
        out["o_proj.weight"] = (h, q)
    elif symbol == MLP:
        out.update(_mlp_shapes("", h, cfg.intermediate_size, cfg.mlp_bias))
    elif symbol == MOE:
        e, inter = cfg.n_routed_experts, cfg.moe_intermediate_size
        d_in = cfg.moe_latent_size if cfg.moe_latent_size is not None else h
        out["gate.weight"] = (e, h)
        out["gate.e_score_correction_bias"] = (e,)
        out["experts.up_proj"] = (e, inter, d_in)
        out["experts.down_proj"] = (e, d_in, inter)
        out.update(_mlp_shapes("shared_experts.", h, cfg.moe_shared_expert_intermediate_size, cfg.mlp_bias))
        if cfg.moe_latent_size is not None:
            out["fc1_latent_proj.weight"] = (cfg.moe_latent_size, h)
            if cfg.mlp_bias:
                out["fc1_latent_proj.bias"] = (cfg.moe_latent_size,)
            out["fc2_latent_proj.weight"] = (h, cfg.moe_latent_size)
            if cfg.mlp_bias:
                out["fc2_latent_proj.bias"] = (h,)
    else:
        raise ValueError(f"layer symbol: expected one of M, *, -, E, got {symbol!r}")
    return out


def _mlp_shapes(prefix: str, hidden: int, inter: int, bias: bool) -> dict[str, tuple[int, ...]]:
    out = {f"{prefix}up_proj.weight": (inter, hidden), f"{prefix}down_proj.weight": (hidden, inter)}
    if bias:
        out[f"{prefix}up_proj.bias"] = (inter,)
        out[f"{prefix}down_proj.bias"] = (hidden,)
    return out


def _block_shapes(cfg: ModelConfig, prefix: str, symbol: str) -> dict[str, tuple[int, ...]]:
    out = {f"{prefix}.norm.weight": (cfg.hidden_size,)}
    out.update({f"{prefix}.mixer.{k}": v for k, v in _mixer_shapes(cfg, symbol).items()})
    return out


def mtp_layout(cfg: ModelConfig) -> list[tuple[str, str, bool, bool]]:
    """(name prefix, block symbol, first layer of its step, last layer of its step) of every MTP layer."""
    pattern = cfg.mtp_layer_types
    return [(f"mtp.layers.{step * len(pattern) + j}", sym, j == 0, j == len(pattern) - 1)
            for step in range(cfg.num_nextn_predict_layers) for j, sym in enumerate(pattern)]


def expected_weight_shapes(cfg: ModelConfig, include_mtp: bool = True) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape of every tensor a checkpoint of `cfg` holds, in HF module order."""
    if cfg.family == QWEN3_5:
        return qwen3_5_weight_shapes(cfg, include_mtp)
    h = cfg.hidden_size
    out: dict[str, tuple[int, ...]] = {"model.embeddings.weight": (cfg.vocab_size, h)}
    for i, symbol in enumerate(cfg.layer_types):
        out.update(_block_shapes(cfg, f"model.layers.{i}", symbol))
    out["model.norm_f.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, h)
    if include_mtp:
        for prefix, symbol, first, last in mtp_layout(cfg):
            if first:
                out[f"{prefix}.enorm.weight"] = (h,)
                out[f"{prefix}.hnorm.weight"] = (h,)
                out[f"{prefix}.eh_proj.weight"] = (h, 2 * h)  # [out, in]: in = [enorm(e); hnorm(h)]
            out.update(_block_shapes(cfg, prefix, symbol))
            if last:
                out[f"{prefix}.final_layernorm.weight"] = (h,)
    return out


def num_parameters(shapes: Mapping[str, tuple[int, ...]]) -> int:
    return sum(math.prod(s) for s in shapes.values())


def canonicalize_names(state: Mapping[str, torch.Tensor], cfg: ModelConfig | None = None) -> dict[str, torch.Tensor]:
    """Rename legacy NemotronH weights to canonical names; stack per-expert weights into 3D tensors (a Qwen3.5
    `cfg`'s: `weights_qwen3_5.canonicalize_qwen3_5`).

    `backbone.X` -> `model.X`; `P.experts.{j}.up_proj.weight` [inter, in] for j = 0..E-1 ->
    `P.experts.up_proj` [E, inter, in] (same for `down_proj`; FP8 scales `...weight_scale` -> `P.experts.up_proj_scale`,
    `...weight_scale_inv` -> `..._scale_inv`). Canonical names pass through unchanged.
    """
    if cfg is not None and cfg.family == QWEN3_5:
        return canonicalize_qwen3_5(state, cfg)
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in state.items():
        if name.startswith(LEGACY_PREFIX):
            name = CANONICAL_PREFIX + name[len(LEGACY_PREFIX):]
        m = _PER_EXPERT.match(name)
        if m:
            name = f"{m['prefix']}.{m['proj']}{stack_suffix(m['leaf'])}"
            experts.setdefault(name, {})[int(m["expert"])] = t
            continue
        if name in out:
            raise ValueError(f"checkpoint: tensor '{name}' appears twice (under its legacy and canonical name)")
        out[name] = t
    for name, by_index in experts.items():
        if name in out:
            raise ValueError(f"checkpoint: tensor '{name}' appears both fused and per expert")
        out[name] = stack_experts(name, by_index)  # [E, out, in] (scales: [E] or [E, row blocks, column blocks])
    return out


def _place_dtype(name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    if t.dtype == torch.float8_e4m3fn:
        return t.dtype  # an FP8 Linear's weight (`layers.fp8_linear`)
    if name.endswith(FP32_SUFFIXES + FP8_SCALE_SUFFIXES + STACK_SCALE_SUFFIXES):
        return torch.float32
    return dtype


def place(state: Mapping[str, torch.Tensor], device: str | torch.device,
          dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Move weights to `device` in `dtype`, except the MoE router, which stays fp32 (as the reference keeps it), and
    FP8 weights and expert stacks and their scales, which keep their float8_e4m3fn and fp32."""
    return {k: v.to(device=device, dtype=_place_dtype(k, v, dtype)) for k, v in state.items()}
