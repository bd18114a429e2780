"""What the fused GEMV kernel (`ops.linear`) reads of a linear layer in a few-token step (`ForwardBatch.fused_gemv`):
a 16-bit `nn.Linear`'s weight, or an `FP8Linear`'s e4m3 weight with its scales (dequantized in the kernel's
registers, so that a decode step reads half the bytes and keeps the norm / relu2 fused in front of the layer).

An FP8 layer takes the GEMV where its own forward runs FP8 kernels (a GPU with FP8 tensor cores) or where the
engine's ops are the torch references (the CPU path, where both compute the dequantized weight's product); not on
older GPUs, and not while it rounds its input through e4m3 for quality checks (`emulate_act_quant`): the GEMV
reads 16-bit inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from baton.engine.layers.fp8_linear import FP8Linear
from baton.engine.ops.kernels import Kernels


@dataclass(frozen=True)
class GemvWeight:
    weight: Tensor
    bias: Tensor | None
    weight_scale: Tensor | None = None  # FP8: per tensor (a scalar) or per `block`
    block: tuple[int, int] | None = None

    def linear(self, kernels: Kernels, a: Tensor) -> Tensor:
        """a @ W^T (+ bias) by the GEMV, no op before it."""
        return kernels.fused_linear(a, self.weight, self.bias, weight_scale=self.weight_scale, block=self.block)


def gemv_weight(layer: nn.Module, kernels: Kernels) -> GemvWeight | None:
    """The layer's weight for the GEMV kernel; None where the layer runs its own forward (see the module
    docstring)."""
    if isinstance(layer, nn.Linear):
        return GemvWeight(layer.weight, layer.bias)
    if not isinstance(layer, FP8Linear) or layer.emulate_act_quant or (kernels.triton and not layer.use_kernel):
        return None
    if layer.block is not None and layer.block[1] & (layer.block[1] - 1):  # the kernel's K groups are powers of two
        return None
    return GemvWeight(layer.weight, layer.bias, layer.scale, layer.block)
