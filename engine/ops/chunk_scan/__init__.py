"""The Mamba2 chunked selective scan (SSD) over a varlen batch of prefill rows, from and into state-pool slots.

`reference.py` holds the torch reference, `kernel.py` the Triton kernels (and the chunk layout the runner builds
from host ints, `build_chunk_meta`). A token's state equals the one of `ssm_update` stepped token by token.
"""
