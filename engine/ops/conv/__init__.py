"""Depthwise causal conv1d + SiLU of the Mamba2 mixer on a conv-state pool: the decode update (one token a row),
the speculative verify (1+K tokens a row, by replay: `ops.spec_verify`) and the varlen prefill.

`reference.py` holds the torch references, `kernel.py` the decode / verify kernels, `kernel_varlen.py` the prefill
kernel; each kernel has its reference's signature and results. A row's window is read from and written back to its
own slot only; a row without an initial state starts from zeros (R2).
"""
