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

# Chunk-parallel prefill (kernel_chunk_wy.py).
# Chunks per program of the chunk table: one program covers most batches; the table is tiny beside the prefill.
WY_TABLE_BLOCK = 1024
# Rows per diagonal block of the UT solve: tl.dot's smallest tile side, so the block products are single tl.dots and
# the serial forward substitution is only this many steps.
WY_SUB = 16
# Warps per program of the prep kernel: its [CHUNK, Dk] key, query and value tiles and [CHUNK, CHUNK] scores share
# the registers.
WY_PREP_WARPS = 8
# State elements per program of the scan (a [Dk, BLOCK_V] tile): the scan is the only serial part, so Dv is split
# into narrow blocks to spread a long row's heads over more programs, while each still reads its chunk's W and
# scores once per BLOCK_V columns.
WY_SCAN_TILE = 4096
# Warps per program of the scan: its [CHUNK, Dk] W and query/key tiles sit beside the state tile.
WY_SCAN_WARPS = 8
# Software-pipeline stages of the scan's chunk loop: the next chunk's W, U and scores load while this one's state
# update runs; each stage holds a chunk's fp32 [CHUNK, Dk] W and [CHUNK, CHUNK] scores in shared memory, so more
# stages would not fit beside the state tile's operands.
WY_SCAN_STAGES = 2
# tl.dot input precisions (the UT solve's, the other products') by whether q, k and v are all fp32: 16-bit inputs
# take tensor-core TF32, except the UT solve, whose inverse amplifies TF32's input rounding, in 3xTF32 (about
# fp32); fp32 inputs get full fp32 products, to stay within fp32 rounding of the reference.
WY_PRECISION = {False: ("tf32x3", "tf32"), True: ("ieee", "ieee")}
# 16-bit inputs: the scan's products take bf16 operands (fp32 sums) at twice TF32's tensor-core rate, since that
# serial loop bounds a long row; its error stays well inside the 16-bit tolerances (the state's bf16 rounding
# decays away chunk after chunk, as in flash-linear-attention). False: TF32 operands, about four times closer.
WY_SCAN_BF16 = True
