"""RMSNorm (computed in fp32): plain, after a residual add (one launch for both), and the gated, grouped norm of the
Mamba2 mixer. `reference.py` holds the torch references, `kernel.py` the Triton kernels with the same results.
"""
