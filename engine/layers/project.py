"""A linear layer without an op before it (Mamba2's out_proj, attention's o_proj) in either kind of step."""

from __future__ import annotations

import torch
from torch import nn

from baton.engine.forward_batch import ForwardBatch
from baton.engine.layers.gemv_weight import gemv_weight
from baton.engine.ops.kernels import Kernels


def project(layer: nn.Module, x: torch.Tensor, batch: ForwardBatch, kernels: Kernels) -> torch.Tensor:
    """layer(x); in a few-token step (`batch.fused_gemv`) through the GEMV kernel, as the step's other linear
    layers: at one row it reads the weight as fast as cuBLAS (benchmarks/gemv_bench.py), and on Hopper it launches
    while the kernel before it finishes (programmatic dependent launch, `ops.triton_common.pdl`), which cuBLAS's
    GEMM and split-K reduction do not. An FP8 layer (`layers.fp8_linear`) takes it too, its e4m3 weight dequantized
    in the kernel (`gemv_weight`)."""
    gw = gemv_weight(layer, kernels) if batch.fused_gemv else None
    if gw is not None:
        return gw.linear(kernels, x)
    return layer(x)
