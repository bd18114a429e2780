"""The Mamba2 selective state update of decode rows (one token each) and of verify rows (1+K tokens each, by replay:
`ops.spec_verify`), on a state pool indexed by slot.

`reference.py` holds the torch references, `kernel.py` the Triton kernels with the same signatures. State math runs
in fp32; the pool keeps its own dtype, and a replayed state is bit-for-bit the one plain decode steps store.
"""
