"""A linear layer with the op before it fused in (none, relu2, RMSNorm, residual add + RMSNorm, gated norm): the GEMV
of few-token steps. `reference.py` holds the torch reference (the separate ops, then F.linear) and the argument
checks both share, `kernel.py` the Triton GEMV, `tuning.py` where it is turned on.
"""
