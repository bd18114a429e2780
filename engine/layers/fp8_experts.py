"""The routed experts' weight stacks, and putting FP8 ones in place of the 16-bit ones where a checkpoint stores them.

An MoE layer's routed experts are 3D stacks [E, rows, cols] (`up_proj` / `down_proj` NemotronH, `gate_up_proj` /
`down_proj` Qwen3.5-MoE). An FP8 stack `P` stays float8_e4m3fn and keeps its scales beside it, named as an FP8
Linear's with the stack's name in place of `weight` (`layers.fp8_linear`): `P_scale` (per tensor: one per expert,
[E]; a gated stack's gate and up rows each theirs, [E, 2]) or `P_scale_inv` (per block: [E, parts * row blocks,
column blocks]); `ops.moe.reference` says the layout. The fused-MoE kernels and the torch reference both take them
(`moe_experts(..., w_up_scale=, w_down_scale=, block=)`): weight-only FP8, the activations stay 16-bit. A checkpoint's
static per-expert `input_scale`s are dropped at load (`fp8_checkpoint.prepare_fp8`): nothing quantizes the
experts' activations.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from baton.engine.ops.fp8_linear.reference import FP8_DTYPE
from baton.engine.ops.moe.reference import expert_scale_shape
from baton.engine.quant_config import STACK_SCALE, STACK_SCALE_INV


class ExpertStacks(nn.Module):
    """A module holding expert stacks as parameters: `STACKS` names them with their segment counts (2: a gated stack's
    gate rows, then its up rows, quantized apart)."""

    STACKS: tuple[tuple[str, int], ...] = ()
    # The checkpoint's weight block where a stack is FP8 with block scales; None: per-tensor scales, or no FP8 stack.
    block: tuple[int, int] | None = None

    def scale(self, name: str) -> Tensor | None:
        """Stack `name`'s scales; None for a 16-bit stack."""
        return self._parameters.get(name + STACK_SCALE, self._parameters.get(name + STACK_SCALE_INV))

    def to_fp8(self, name: str, parts: int, block: tuple[int, int] | None) -> None:
        """Make stack `name` an FP8 one with its scales, on the meta device (the load assigns the tensors)."""
        shape = tuple(getattr(self, name).shape)
        with torch.device("meta"):
            setattr(self, name, nn.Parameter(torch.empty(shape, dtype=FP8_DTYPE), requires_grad=False))
            scale = torch.empty(expert_scale_shape(shape, block, parts), dtype=torch.float32)
            self.register_parameter(name + (STACK_SCALE if block is None else STACK_SCALE_INV),
                                    nn.Parameter(scale, requires_grad=False))
        if block is not None:
            self.block = block


def swap_fp8_experts(module: nn.Module, state: Mapping[str, Tensor], block: tuple[int, int] | None = None
                     ) -> list[str]:
    """Make each expert stack of `module` that `state` holds in FP8 (names relative to `module`) an FP8 one; return
    their names. `block`: the checkpoint's weight block (None: per tensor)."""
    swapped = []
    for prefix, child in list(module.named_modules()):
        if not isinstance(child, ExpertStacks):
            continue
        for name, parts in child.STACKS:
            full = f"{prefix}.{name}" if prefix else name
            w = state.get(full)
            if w is None or w.dtype != FP8_DTYPE:
                continue
            per_tensor, per_block = full + STACK_SCALE in state, full + STACK_SCALE_INV in state
            if per_tensor == per_block or per_block != (block is not None):
                raise ValueError(f"fp8 experts: '{full}' is float8_e4m3fn, expected its "
                                 f"'{full}{STACK_SCALE_INV if block is not None else STACK_SCALE}' "
                                 f"({'per-block' if block else 'per-tensor'} scales, as quantization_config says), "
                                 f"got {[n for n in (full + STACK_SCALE, full + STACK_SCALE_INV) if n in state] or 'none'}")
            child.to_fp8(name, parts, block)
            swapped.append(full)
    return swapped
