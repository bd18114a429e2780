"""FP8 linear layers: y = x @ (fp8 weight * its scales)^T + bias. `reference.py` holds the quantizers and the
dequantizing torch reference (any device, the CPU path), `kernel.py` the GPU path (torch's scaled matmul for
per-tensor scales, a Triton block-scaled GEMM for 128x128 blocks), which also quantizes the activations.
"""
