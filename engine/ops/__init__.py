"""Batched varlen operators, one package per op: `reference.py` (torch: the CPU path and the tests' ground truth)
beside `kernel*.py` (Triton) with the same signatures and results. Shared: `checks.py`, `triton_common.py`,
`spec_verify.py` (the verify replay both Mamba2 state ops follow); `kernels.py` picks one side per engine."""
