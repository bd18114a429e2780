"""Tuning of the Gated DeltaNet kernels, each entry with its reason."""

# State elements per program of decode and verify (a [Dk, BLOCK_V] tile): Dv is split so a row's heads spread over
# enough programs to fill the GPU at small batches while each tile still fits in registers.
STEP_TILE = 4096
# State elements per program of the recurrent prefill: a longer walk per program favours a smaller register tile.
PREFILL_TILE = 2048
# State elements per program of the chunked prefill: its [Dk, BLOCK_V] state sits beside [CHUNK, Dk] key, query and
# WY tiles, so the value block stays narrow.
CHUNKED_TILE = 4096
# Warps per program of the chunked prefill: its [CHUNK, Dk] tiles need more registers than one step's tile.
CHUNKED_WARPS = 8
# fp32 products of the chunked prefill in full fp32 ("ieee"): the WY solve amplifies TF32's input rounding.
DOT_PRECISION = "ieee"
# Warps per program of decode, verify and prefill: the [Dk, BLOCK_V] tile's reductions run over Dk.
STEP_WARPS = 4
# Elements per program of the verify inputs' record: a wide block keeps that copy to few programs.
RECORD_BLOCK = 1024
