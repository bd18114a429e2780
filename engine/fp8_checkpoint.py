"""The FP8 tensors of a checkpoint: checking and preparing them as they load, and making them for `make_model`.

Loading (`prepare_fp8`, on the checkpoint's own names, before `weights.canonicalize_names`): every float8_e4m3fn
`P.weight` must come with its scale (`P.weight_scale` per tensor, `P.weight_scale_inv` per block, as the
checkpoint's `quantization_config` says: `quant_config.py`) of the right shape, and `P` must not be on the
format's ignore list; every scale must belong to such a weight. The FP8 weights of Linears the engine runs as
`layers.fp8_linear.FP8Linear` stay FP8 with their scales, and so do the routed experts
(`...experts.{j}.up_proj.weight`), which the canonicalization stacks into 3D tensors with their scales stacked
beside them (`P_scale` [E], `P_scale_inv` [E, row blocks, column blocks]: `layers.fp8_experts`); the fused-MoE
kernels read them as e4m3 (weight-only), so an expert's static `input_scale` is dropped here. The others are
dequantized to the model dtype here: `lm_head` (read as a raw weight by the logits and the GEMV kernel), MoE
routers and Qwen3-Next's interleaved GDN projections (split by the canonicalization, which would separate a block
scale from its rows).

Kept as fp32 scalars: ModelOpt's FP8 KV-cache scales (`*.k_scale`, `*.v_scale`), which an engine with
`--kv-cache-dtype fp8` quantizes its KV pool with (`kv_cache_dtype.py`; the engine takes them out of the weights).

Writing (`quantize_for_checkpoint`): every 2D Linear weight except embeddings, `lm_head` and the MoE routers,
and the routed experts (written per expert as the FP8 checkpoints store them: NemotronH's `up_proj` / `down_proj`,
Qwen3.5-MoE's `gate_proj`, `up_proj`, `down_proj`), in the format of an `FP8Config`; Mamba's conv, A_log, D,
dt_bias and the norms are not Linears and stay as they are.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re

import torch
from torch import Tensor

from baton.engine.config import ModelConfig
from baton.engine.ops.fp8_linear.reference import (
    FP8_DTYPE,
    dequantize,
    quantize_blockwise,
    quantize_per_tensor,
)
from baton.engine.ops.moe.reference import dequantize_experts
from baton.engine.quant_config import (
    INPUT_SCALE,
    KV_SCALE_SUFFIXES,
    STACK_SCALE,
    STACK_SCALE_INV,
    WEIGHT_SCALE,
    WEIGHT_SCALE_INV,
    FP8Config,
)
from baton.engine.weights import canonicalize_names

logger = logging.getLogger(__name__)
_SCALES = (WEIGHT_SCALE, WEIGHT_SCALE_INV, INPUT_SCALE)
# Modules whose FP8 weight is dequantized at load (see the module docstring).
_DENSE_ONLY = re.compile(r"((^|\.)lm_head$|\.(mixer|mlp)\.gate$|\.shared_expert_gate$|\.in_proj_qkvz$"
                         r"|\.in_proj_ba$)")
# Checkpoint (canonical) names never quantized by `quantize_for_checkpoint`.
_NEVER = re.compile(r"(^model\.embeddings\.weight$|^model\.embed_tokens\.weight$|^lm_head\.weight$"
                    r"|\.(mixer|mlp)\.gate\.weight$|\.shared_expert_gate\.weight$)")
# A routed expert's module (checkpoint names): weight-only FP8, no activation scale.
_ROUTED_EXPERT = re.compile(r"\.experts\.\d+\.")
_FUSED_EXPERTS = re.compile(r"^(?P<prefix>.*\.(mixer|mlp)\.experts)\.(?P<proj>up_proj|gate_up_proj|down_proj)$")


def _scale_shape(weight: Tensor, qcfg: FP8Config) -> tuple[int, ...]:
    if qcfg.block_size is None:
        return ()
    return tuple(math.ceil(n / b) for n, b in zip(weight.shape, qcfg.block_size, strict=True))


def prepare_fp8(raw: dict[str, Tensor], qcfg: FP8Config | None, dtype: torch.dtype) -> dict[str, Tensor]:
    """Check and prepare the FP8 tensors of `raw` (checkpoint names), in place; return it."""
    for n in [n for n in raw if n.endswith(KV_SCALE_SUFFIXES)]:
        if raw[n].numel() != 1:
            raise ValueError(f"weights: KV-cache scale '{n}' expected one value, got shape {list(raw[n].shape)}")
        raw[n] = raw[n].float().reshape(())
    fp8 = [n for n, t in raw.items() if t.dtype == FP8_DTYPE]
    if fp8 and qcfg is None:
        raise ValueError(f"weights: '{fp8[0]}' is float8_e4m3fn, expected a quantization_config in config.json "
                         f"(or a ModelOpt hf_quant_config.json), got none")
    owners = set()
    for name in fp8:
        module, sep, leaf = name.rpartition(".")
        if leaf != "weight" or not sep:
            raise ValueError(f"weights: '{name}' is float8_e4m3fn, expected only Linear weights (*.weight) in FP8")
        if qcfg.is_ignored(module):
            raise ValueError(f"weights: '{name}' is float8_e4m3fn, but quantization_config's ignore list names "
                             f"'{module}' (expected it unquantized)")
        w = raw[name]
        scale_name = f"{module}.{qcfg.scale_name}"
        scale = raw.get(scale_name)
        if scale is None:
            raise ValueError(f"weights: '{name}' is float8_e4m3fn, expected its scale '{scale_name}' "
                             f"(quant_method {qcfg.quant_method!r}), found none")
        want = _scale_shape(w, qcfg)
        if math.prod(scale.shape) != math.prod(want) or (want and tuple(scale.shape) != want):
            raise ValueError(f"weights: '{scale_name}' expected shape {list(want)} for weight {list(w.shape)}, "
                             f"got {list(scale.shape)}")
        raw[scale_name] = scale = scale.float().reshape(want)
        input_name = f"{module}.{INPUT_SCALE}"
        if input_name in raw:
            if qcfg.block_size is not None:
                raise ValueError(f"weights: '{input_name}': expected no static input scales with block-wise FP8 "
                                 f"(activation_scheme 'dynamic'), got one")
            if raw[input_name].numel() != 1:
                raise ValueError(f"weights: '{input_name}' expected one value, got shape {list(raw[input_name].shape)}")
            raw[input_name] = raw[input_name].float().reshape(())
        if _ROUTED_EXPERT.search(module):
            raw.pop(input_name, None)
        if _DENSE_ONLY.search(module):
            raw[name] = dequantize(w, scale, qcfg.block_size).to(dtype)
            del raw[scale_name]
            raw.pop(input_name, None)
        else:
            owners.add(module)
    orphans = [n for n in raw if n.rpartition(".")[2] in _SCALES and n.rpartition(".")[0] not in owners]
    if orphans:
        raise ValueError(f"weights: scale tensor(s) {orphans[:8]} without a float8_e4m3fn '.weight' beside them "
                         f"(expected scales only of FP8 Linears)")
    return raw


def stack_of_scale(name: str) -> str | None:
    """The expert stack a stack scale name belongs to (`P_scale`, `P_scale_inv` -> `P`), else None."""
    for suffix in (STACK_SCALE_INV, STACK_SCALE):
        if name.endswith(suffix) and ".experts." in name:
            return name[:-len(suffix)]
    return None


def is_fp8_sidecar(name: str, state: dict[str, Tensor]) -> bool:
    """Whether `name` is the scale of an FP8 weight or expert stack in `state` (canonical names)."""
    module, _, leaf = name.rpartition(".")
    w = state.get(f"{module}.weight") if leaf in _SCALES else None
    stack = stack_of_scale(name)
    if w is None and stack is not None:
        w = state.get(stack)
    return w is not None and w.dtype == FP8_DTYPE


def quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """Whether `quantize_for_checkpoint` stores canonical tensor `name` in FP8."""
    if _FUSED_EXPERTS.match(name):
        return True
    return name.endswith(".weight") and len(shape) == 2 and not _NEVER.search(name)


def _quantize(module: str, w: Tensor, qcfg: FP8Config) -> dict[str, Tensor]:
    if qcfg.block_size is None:
        q, s = quantize_per_tensor(w)
    else:
        q, s = quantize_blockwise(w, qcfg.block_size)
    return {f"{module}.weight": q, f"{module}.{qcfg.scale_name}": s}


def quantize_for_checkpoint(name: str, t: Tensor, qcfg: FP8Config) -> dict[str, Tensor]:
    """Checkpoint tensors for canonical tensor `name` (fp32 value `t`): itself where not `quantizable`, else its FP8
    weight and scale; fused experts [E, out, in] become per-expert `...experts.{j}.{proj}.weight` (a Qwen
    `gate_up_proj` its `gate_proj` and `up_proj` halves)."""
    if not quantizable(name, tuple(t.shape)):
        return {name: t}
    m = _FUSED_EXPERTS.match(name)
    if m:
        out: dict[str, Tensor] = {}
        for j in range(t.shape[0]):
            parts = zip(("gate_proj", "up_proj"), t[j].chunk(2), strict=True) if m["proj"] == "gate_up_proj" else \
                ((m["proj"], t[j]),)
            for proj, w in parts:
                out.update(_quantize(f"{m['prefix']}.{j}.{proj}", w, qcfg))
        return out
    return _quantize(name[:-len(".weight")], t, qcfg)


def unquantized_linears(shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """The Linear modules (2D weights, embeddings aside) `quantize_for_checkpoint` leaves unquantized: the ignore
    list a written checkpoint declares."""
    return [n[:-len(".weight")] for n, s in shapes.items()
            if n.endswith(".weight") and len(s) == 2 and _NEVER.search(n) and "embed" not in n]


def quantize_state(cfg: ModelConfig, state: dict[str, Tensor], qcfg: FP8Config,
                   dtype: torch.dtype) -> tuple[ModelConfig, dict[str, Tensor]]:
    """(config, canonical state) of the FP8 checkpoint that `quantize_for_checkpoint` makes of a loaded 16/32-bit
    one, as `loader.load_checkpoint` would return it: the in-memory twin of `make_model(..., quantize=...)`."""
    raw: dict[str, Tensor] = {}
    for name, t in state.items():
        for k, v in quantize_for_checkpoint(name, t.float(), qcfg).items():
            raw[k] = v if v.dtype == FP8_DTYPE or k != name else t
    prepare_fp8(raw, qcfg, dtype)
    return dataclasses.replace(cfg, quantization=qcfg), canonicalize_names(raw, cfg)


def dequantize_state(state: dict[str, Tensor], dtype: torch.dtype) -> dict[str, Tensor]:
    """`state` with every FP8 weight replaced by its dequantized value in `dtype` and the scales dropped: the
    16-bit model an FP8 one computes exactly like on the reference path."""
    out = {}
    for name, t in state.items():
        if is_fp8_sidecar(name, state):
            continue
        if t.dtype == FP8_DTYPE and t.dim() == 3:
            t = _dequantize_stack(name, t, state).to(dtype)
        elif t.dtype == FP8_DTYPE:
            module = name[:-len(".weight")]
            inv = state.get(f"{module}.{WEIGHT_SCALE_INV}")
            scale = inv if inv is not None else state[f"{module}.{WEIGHT_SCALE}"]
            block = None if inv is None else _block(t, inv)
            t = dequantize(t, scale, block).to(dtype)
        out[name] = t
    return out


def _dequantize_stack(name: str, t: Tensor, state: dict[str, Tensor]) -> Tensor:
    """An FP8 expert stack's fp32 value (its segments each with their scales: `ops.moe.reference`)."""
    parts = 2 if name.endswith("gate_up_proj") else 1
    inv = state.get(name + STACK_SCALE_INV)
    if inv is None:
        return dequantize_experts(t, state[name + STACK_SCALE], None, parts)
    return dequantize_experts(t, inv, _block(t[0].chunk(parts)[0], inv[0].chunk(parts)[0]), parts)


def _block(weight: Tensor, scale_inv: Tensor) -> tuple[int, int]:
    """The block of a block-scale grid: the smallest power of two per dimension whose blocks the grid counts."""
    def one(n: int, nb: int) -> int:
        b = 1
        while -(-n // b) > nb:
            b *= 2
        return b
    return one(weight.shape[0], scale_inv.shape[0]), one(weight.shape[1], scale_inv.shape[1])
