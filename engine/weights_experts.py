"""Stacking a checkpoint's per-expert tensors into the routed experts' 3D stacks (`weights.canonicalize_names`,
`weights_qwen3_5.canonicalize_qwen3_5`): the weights, and an FP8 checkpoint's scales beside them under the stack's
name (`quant_config.STACK_SCALE` / `STACK_SCALE_INV`)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from baton.engine.quant_config import STACK_SCALE, STACK_SCALE_INV

# An FP8 expert stack's scales (`...experts.up_proj_scale`, `..._scale_inv`), kept fp32 as a Linear's are.
STACK_SCALE_SUFFIXES = ("_proj" + STACK_SCALE, "_proj" + STACK_SCALE_INV)


def stack_suffix(leaf: str) -> str:
    """The suffix of a stack's tensor after the stack's name, for a per-expert Linear's leaf: `weight` -> '',
    `weight_scale` -> '_scale', `weight_scale_inv` -> '_scale_inv' (`quant_config.STACK_SCALE`)."""
    return leaf[len("weight"):]


def stack_experts(name: str, by_index: Mapping[int, torch.Tensor]) -> torch.Tensor:
    """Experts 0..E-1's tensors of stack `name` stacked along a new first dim: all of them present, of one dtype
    (an FP8 stack's experts all FP8), else ValueError."""
    n = max(by_index) + 1
    missing = [j for j in range(n) if j not in by_index]
    if missing:
        raise ValueError(f"checkpoint: per-expert weights of '{name}': expected experts 0..{n - 1}, "
                         f"missing {missing[:8]}")
    dtypes = sorted({str(t.dtype) for t in by_index.values()})
    if len(dtypes) > 1:
        raise ValueError(f"checkpoint: per-expert weights of '{name}': expected one dtype for all experts, got "
                         f"{dtypes}")
    return torch.stack([by_index[j] for j in range(n)], dim=0)
