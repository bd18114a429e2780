"""The routed experts of a MoE layer (NemotronH's non-gated relu2 experts, Qwen3.5-MoE / Qwen3-Next's gated SiLU
experts), run as the fused-MoE kernels run them: route each token to its top-k experts, sort the (token, expert)
rows by expert padded to blocks of BLOCK_M, one grouped GEMM up (activation fused), one grouped GEMM down (routing
weight fused), then sum each token's top-k rows. `reference.py` holds the torch reference (also the CPU path and the
routing both paths share), `kernel_align.py` / `kernel.py` the Triton kernels, `tuning.py` their tiles.
"""
