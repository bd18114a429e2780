"""The attention KV pool's storage dtype (`EngineConfig.kv_cache_dtype`) and, for FP8, its per-layer scales.

"auto" stores K and V in the model dtype. "fp8" stores them as float8_e4m3fn, as vLLM's `--kv-cache-dtype fp8`:
a write stores clamp(x / scale, -FP8_MAX, FP8_MAX) and a read takes the stored value times the scale, one scale
for K and one for V per attention layer (the drafter's included). The scales are the checkpoint's where it ships
them (ModelOpt's `kv_cache_quant_algo: FP8`: `<attention module>[.k_proj|.v_proj|.attn].k_scale` / `.v_scale`,
dequantizing scales), else 1.0. They live in one device tensor `[L_attn + L_mtp, 2]` (K, V) whose rows the
attention layers hold: the kernels read them on the device, so a CUDA graph replays them without a host sync.
"""

from __future__ import annotations

import logging
import math
import re

import torch
from torch import nn

from baton.engine.quant_config import KV_SCALE_SUFFIXES

log = logging.getLogger(__name__)

AUTO, FP8 = "auto", "fp8"
FP8_KV_DTYPE = torch.float8_e4m3fn
# Compute capability from which Triton converts float8_e4m3fn on the GPU (Ada, Hopper and later).
_FP8_MIN_CAPABILITY = (8, 9)
# A checkpoint's scale may sit on the attention module itself or on its k/v projection (or vLLM's `.attn`).
_OWNER_SUFFIX = re.compile(r"\.(k_proj|v_proj|attn)$")


def resolve_kv_dtype(kv_cache_dtype: str, dtype: torch.dtype, device: torch.device, triton: bool) -> torch.dtype:
    """The KV pool's torch dtype: `dtype` (the model's) for "auto", float8_e4m3fn for "fp8". Raises ValueError
    where FP8 cannot run: a GPU whose Triton has no float8_e4m3fn conversion (compute capability below 8.9)."""
    if kv_cache_dtype == AUTO:
        return dtype
    if kv_cache_dtype != FP8:
        raise ValueError(f"engine field 'kv_cache_dtype': expected one of {AUTO}, {FP8}, got {kv_cache_dtype!r}")
    if device.type == "cuda" and triton:
        cap = torch.cuda.get_device_capability(device)
        if cap < _FP8_MIN_CAPABILITY:
            raise ValueError(f"engine field 'kv_cache_dtype': expected 'auto' on {torch.cuda.get_device_name(device)} "
                             f"(compute capability {cap[0]}.{cap[1]}; the Triton kernels convert float8_e4m3fn from "
                             f"{_FP8_MIN_CAPABILITY[0]}.{_FP8_MIN_CAPABILITY[1]} on), got 'fp8'")
    elif device.type not in ("cuda", "cpu"):
        raise ValueError(f"engine field 'kv_cache_dtype': expected 'auto' on a {device.type} device (fp8 runs on "
                         f"CUDA and the CPU), got 'fp8'")
    return FP8_KV_DTYPE


def is_kv_scale(name: str) -> bool:
    return name.endswith(KV_SCALE_SUFFIXES)


def split_kv_scales(state: dict[str, torch.Tensor]) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """(the checkpoint's KV-cache scales as floats by name, the other tensors). ValueError for a scale that is not
    one positive finite value."""
    scales: dict[str, float] = {}
    for name, t in state.items():
        if not is_kv_scale(name):
            continue
        if t.numel() != 1:
            raise ValueError(f"weights: KV-cache scale '{name}' expected one value, got shape {list(t.shape)}")
        v = float(t.float().reshape(()))
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"weights: KV-cache scale '{name}' expected a positive finite value, got {v}")
        scales[name] = v
    return scales, {k: t for k, t in state.items() if k not in scales}


def _attention_layers(module: nn.Module, prefix: str) -> dict[str, nn.Module]:
    """Attention layers (those with a `kv_index`) by checkpoint module path."""
    return {prefix + name: m for name, m in module.named_modules() if hasattr(m, "kv_index")}


def kv_scale_table(model: nn.Module, mtp: nn.Module | None, scales: dict[str, float],
                   device: torch.device) -> torch.Tensor:
    """[L_attn + L_mtp, 2] fp32 (K, V) on `device`: 1.0 except where `scales` (checkpoint names, `split_kv_scales`)
    give a layer's; the drafter's layers follow the target's, as in the KV pool (`cache_pools`). ValueError for a
    scale of no attention layer."""
    target = _attention_layers(model, "")
    drafter = _attention_layers(mtp, "mtp.") if mtp is not None else {}
    n_target = len(target)
    table = torch.ones(n_target + len(drafter), 2, dtype=torch.float32)
    for name, v in scales.items():
        owner, _, leaf = name.rpartition(".")
        owner = _OWNER_SUFFIX.sub("", owner)
        layer = target.get(owner)
        row = None if layer is None else layer.kv_index
        if layer is None and owner in drafter:
            row = n_target + drafter[owner].kv_index
        if row is None:
            if owner.startswith("mtp.") and mtp is None:
                continue  # the drafter is not loaded (no speculative decoding): its scales have no pool layer
            raise ValueError(f"weights: KV-cache scale '{name}' expected on an attention layer "
                             f"({', '.join(sorted(target)[:4])}, ...), got none at '{owner}'")
        table[row, 0 if leaf == "k_scale" else 1] = v
    return table.to(device)


def bind_kv_scales(model: nn.Module, mtp: nn.Module | None, table: torch.Tensor | None) -> None:
    """Give every attention layer its row of `table` (`kv_scale_table`), or None (a 16-bit pool: no scales)."""
    n_target = 0
    for m in _attention_layers(model, "").values():
        m.kv_scale = None if table is None else table[m.kv_index]
        n_target += 1
    if mtp is not None:
        for m in _attention_layers(mtp, "").values():
            m.kv_scale = None if table is None else table[n_target + m.kv_index]
