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
# Decode launches by batch size, (smallest batch, STEP_TILE-like tile, warps), the last entry whose batch is reached
# applies: a decode step's state traffic grows with the batch, and the tile that fills the GPU at one row is not the
# one that streams the state fastest at hundreds.
DECODE_LAUNCH = ((1, STEP_TILE, STEP_WARPS), (16, 4096, 2), (128, 8192, 4))


def decode_launch(batch: int) -> tuple[int, int]:
    """(tile, warps) of a decode launch over `batch` rows."""
    tile, warps = DECODE_LAUNCH[0][1:]
    for start, t, w in DECODE_LAUNCH:
        if batch >= start:
            tile, warps = t, w
    return tile, warps
