"""Tuning of the Gated DeltaNet kernels, each entry with its reason."""

# State elements per program of decode and verify (a [Dk, BLOCK_V] tile): Dv is split so a row's heads spread over
# enough programs to fill the GPU at small batches while each tile still fits in registers.
STEP_TILE = 4096
# State elements per program of the recurrent prefill: a longer walk per program favours a smaller register tile.
PREFILL_TILE = 2048
# Warps per program of decode, verify and prefill: the [Dk, BLOCK_V] tile's reductions run over Dk.
STEP_WARPS = 4
# Elements per program of the verify inputs' record: a wide block keeps that copy to few programs.
RECORD_BLOCK = 1024
