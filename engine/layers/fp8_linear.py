"""An FP8 Linear layer, and putting it in a model in place of the `nn.Linear`s a checkpoint stores in FP8.

`FP8Linear` holds the checkpoint's tensors under the checkpoint's names (`weight` float8_e4m3fn [out, in], its
scale `weight_scale` (per tensor) or `weight_scale_inv` (per block), `input_scale` where the checkpoint has a
static one, `bias`), so a state dict loads as is. Which implementation runs is fixed once the weights are in
place (`bind`), from where they live: a GPU with FP8 tensor cores (compute capability 8.9+, i.e. Hopper) takes
`ops.fp8_linear.kernel` (FP8 GEMMs, activations quantized as the format prescribes); anything else takes the
dequantizing reference (`ops.fp8_linear.reference`: CPU tests, and older GPUs, which have no FP8 GEMM). The choice
is the weights' device's, not the engine's `Kernels` binding: there is one FP8 implementation per device kind, and
the reference is the only one that exists on a CPU.

Few-token steps (`ForwardBatch.fused_gemv`) read an FP8Linear's e4m3 weight and scales with the fused GEMV kernel
instead, the block's norm (or relu2) fused in front of it as for a 16-bit layer (`layers.gemv_weight`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from baton.engine.ops.fp8_linear.reference import FP8_DTYPE, fp8_linear_reference
from baton.engine.quant_config import INPUT_SCALE, WEIGHT_SCALE, WEIGHT_SCALE_INV

FP8_CAPABILITY = (8, 9)  # the first compute capability with float8_e4m3fn tensor cores


def fp8_gemm_supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= FP8_CAPABILITY


class FP8Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, block: tuple[int, int] | None,
                 static_input: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.block = block
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False)
        if block is None:
            self.weight_scale = nn.Parameter(torch.empty((), dtype=torch.float32), requires_grad=False)
        else:
            nb, kb = -(-out_features // block[0]), -(-in_features // block[1])
            self.weight_scale_inv = nn.Parameter(torch.empty(nb, kb, dtype=torch.float32), requires_grad=False)
        self.input_scale = (nn.Parameter(torch.empty((), dtype=torch.float32), requires_grad=False)
                            if static_input else None)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.use_kernel = False
        # Reference path only: round the input through e4m3 as the kernels do (quality checks of W8A8 on a CPU).
        self.emulate_act_quant = False

    @property
    def scale(self) -> Tensor:
        return self.weight_scale if self.block is None else self.weight_scale_inv

    def bind(self) -> None:
        """Pick the implementation from the loaded weights' device (see the module docstring)."""
        self.use_kernel = fp8_gemm_supported(self.weight.device)

    def forward(self, x: Tensor) -> Tensor:
        if self.use_kernel:
            from baton.engine.ops.fp8_linear import kernel  # Triton: imported only where it runs

            if self.block is None:
                return kernel.fp8_linear_per_tensor(x, self.weight, self.weight_scale, self.bias, self.input_scale)
            return kernel.fp8_linear_blockwise(x, self.weight, self.weight_scale_inv, self.block, self.bias)
        return fp8_linear_reference(x, self.weight, self.scale, self.block, self.bias, self.input_scale,
                                    act_quant=self.emulate_act_quant)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, block={self.block}, "
                f"static_input={self.input_scale is not None}, kernel={self.use_kernel}")


def swap_fp8_linears(module: nn.Module, state: Mapping[str, Tensor],
                     block: tuple[int, int] | None = None) -> list[str]:
    """Replace each `nn.Linear` of `module` whose `weight` `state` holds in FP8 (names relative to `module`) by an
    `FP8Linear` of the same shape, made on the meta device; return their names. `block`: the checkpoint's weight
    block (None: per tensor)."""
    swapped = []
    for name, child in list(module.named_modules()):
        if not isinstance(child, nn.Linear):
            continue
        w = state.get(f"{name}.weight")
        if w is None or w.dtype != FP8_DTYPE:
            continue
        inv = state.get(f"{name}.{WEIGHT_SCALE_INV}")
        if inv is None and f"{name}.{WEIGHT_SCALE}" not in state:
            raise ValueError(f"fp8 weights: '{name}.weight' is float8_e4m3fn but neither '{name}.{WEIGHT_SCALE}' nor "
                             f"'{name}.{WEIGHT_SCALE_INV}' is in the checkpoint")
        if (inv is not None) != (block is not None):
            raise ValueError(f"fp8 weights: '{name}' has a {'block' if inv is not None else 'per-tensor'} scale, "
                             f"expected {'per-block' if block else 'per-tensor'} scales as quantization_config says")
        blk = block
        with torch.device("meta"):
            new = FP8Linear(child.in_features, child.out_features, child.bias is not None, blk,
                            f"{name}.{INPUT_SCALE}" in state)
        parent_name, _, leaf = name.rpartition(".")
        setattr(module.get_submodule(parent_name) if parent_name else module, leaf, new)
        swapped.append(name)
    return swapped


def bind_fp8_linears(module: nn.Module) -> None:
    for m in module.modules():
        if isinstance(m, FP8Linear):
            m.bind()
