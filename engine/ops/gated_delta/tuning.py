"""Tuning of the Gated DeltaNet kernels, each entry with its reason."""

from typing import NamedTuple

# State elements per program of decode and verify (a [Dk, BLOCK_V] tile): Dv is split so a row's heads spread over
# enough programs to fill the GPU at small batches while each tile still fits in registers.
STEP_TILE = 4096
# State elements per program of the recurrent prefill: a longer walk per program favours a smaller register tile.
PREFILL_TILE = 2048
# Warps per program of decode, verify and prefill: the [Dk, BLOCK_V] tile's reductions run over Dk.
STEP_WARPS = 4
# Elements per program of the verify inputs' record: a wide block keeps that copy to few programs.
RECORD_BLOCK = 1024
# Decode launches by batch size, the last entry whose batch is reached applies: a decode step's state traffic grows
# with the batch, and the tile that fills the GPU at one row is not the one that streams the state fastest at
# hundreds. Each entry: (smallest batch, STEP_TILE-like tile, warps, tiles per program: more than one issues the
# next tile's state read before this one's update, stream: L2 eviction hints on the state's read and write).
DECODE_LAUNCH = ((1, STEP_TILE, STEP_WARPS, 1, False), (16, 8192, 4, 1, True), (128, 8192, 4, 1, True))


# Chunk-parallel prefill (kernel_chunk_wy.py).
# Chunks per program of the chunk table: one program covers most batches; the table is tiny beside the prefill.
WY_TABLE_BLOCK = 1024
# Largest chunk the chunk-parallel kernels take (larger ones run token by token): at head dim 128 a chunk of 128 puts
# the scan's pipelined [CHUNK, Dk] and [CHUNK, CHUNK] tiles past an SM's shared memory.
WY_MAX_CHUNK = 64
# Rows per diagonal block of the UT solve: tl.dot's smallest tile side; a chunk is at most four such blocks.
WY_SUB = 16
# Warps per program of the prep's solve launch: its [16, 16] blocks and [16, WY_SOLVE_BK] key slices; two warps
# leave registers for more programs per SM, which hides the forward substitution's serial steps better than four.
WY_SOLVE_WARPS = 2
# Key columns the solve launch multiplies at a time: ten [16, 16] accumulators and four key slices stay in registers
# (wider slices spill).
WY_SOLVE_BK = 32
# How the solve inverts its four [16, 16] diagonal blocks: True, the product (I - A)(I + A^2)(I + A^4)(I + A^8) in
# six full-fp32 tile products; False, forward substitution (14 dependent steps of two cross-thread reductions each).
# Both are within fp32 rounding of each other; the product's launch is the shorter (`gdn_bench.py --solve-doubling`
# times both).
WY_SOLVE_DOUBLING = True
# Warps per program of the prep's second launch (W, U, the scores): four, two programs per SM, beat eight, one
# program per SM without spilling: the launch waits on memory more than on its spilled registers.
WY_PREP_WARPS = 4
# Head-dim columns the second launch multiplies at a time: wider products beside T spill more.
WY_PREP_COLS = 32
# Software-pipeline stages of the prep launches' loops over the head dims (the solve's key slices; W/U's key, query
# and value columns): three each, so the next slices load while this one's product runs. Both launches' occupancy
# is bound by their registers, not by the extra shared memory, and their warps wait mostly on operand loads
# (`gdn_bench.py --stages-sweep` times the choices). fp32 inputs run one stage, as in the scan: their tiles are
# twice the size.
WY_SOLVE_STAGES = 3
WY_PREP_STAGES = 3
# State elements per program of the scan (a [Dk, BLOCK_V] tile): at head dim 128 a value block of 64 columns, so
# one row's Hv * 2 programs fit on the GPU's SMs at once (the scan holds most of an SM's registers and shared
# memory: a second wave of programs would double a long row's time), each reading its chunk's W, q, k and scores
# once per 64 columns.
WY_SCAN_TILE = 8192
# Warps per program of the scan: its [CHUNK, Dk] W and query/key tiles sit beside the [Dk, 64] state tile.
WY_SCAN_WARPS = 8
# Software-pipeline stages of the scan's chunk loop (16-bit inputs): the next chunks' W, U, q, k and scores load
# while this chunk's state update runs; three beat two on the 27B layer's shapes. fp32 inputs run one stage: their
# fp32 tiles would not fit twice in shared memory.
WY_SCAN_STAGES = 3
# tl.dot input precisions (the UT system and its block solve, the prep's other products) by whether q, k and v are
# all fp32. 16-bit inputs: tensor-core TF32 for both; 3xTF32 for the solve would double the prep's shared memory,
# halving the programs an SM holds, for an error far below the scan's bf16 rounding. fp32 inputs: full fp32
# products, to stay within fp32 rounding of the reference.
WY_PRECISION = {False: ("tf32", "tf32"), True: ("ieee", "ieee")}
# 16-bit inputs: the scan's products take bf16 operands (fp32 sums) at twice TF32's tensor-core rate, since that
# serial loop bounds a long row; its error stays well inside the 16-bit tolerances (the state's bf16 rounding
# decays away chunk after chunk, as in flash-linear-attention). False: TF32 operands, about four times closer.
WY_SCAN_BF16 = True
# The second stage of the chunk-parallel prefill: False, the fused scan (`_wy_scan_kernel`: state and outputs in one
# serial loop); True, the split one (`kernel_chunk_state.py`, flash-linear-attention's shape: a state kernel that only
# carries the recurrence and stores each chunk's start state, then a fully parallel output kernel). The fused scan
# stays the default; the split one is the alternative kept selectable so the benchmark times both in one run.
WY_SPLIT_SCAN = False
# State elements per program of the split state kernel (a [Dk, BLOCK_V] tile): with no output tiles beside the state
# it can take a narrower value block than the fused scan, so a single row spreads over more programs and SMs.
WY_STATE_TILE = 4096
# Warps per program of the split state kernel: its tiles are the state and one chunk's W, U and decayed keys.
WY_STATE_WARPS = 4
# Software-pipeline stages of the split state kernel's chunk loop (16-bit inputs; fp32 inputs run one stage, as the
# fused scan): the next chunk's W, U and keys load while this chunk's update runs, which hides their latency; more
# buffers could stop two programs sharing an SM, putting a single row's programs in two waves.
WY_STATE_STAGES = 2
# State elements per program of the split output kernel and its warps: every (chunk, value head, value block) is
# independent, so the tile only has to fit its q, scores, start state and new values in registers.
WY_OUT_TILE = 8192
WY_OUT_WARPS = 4


class DecodeLaunch(NamedTuple):
    tile: int
    warps: int
    tiles: int
    stream: bool


def decode_launch(batch: int) -> DecodeLaunch:
    """The launch of a decode over `batch` rows (`DECODE_LAUNCH`)."""
    chosen = DecodeLaunch(*DECODE_LAUNCH[0][1:])
    for start, *launch in DECODE_LAUNCH:
        if batch >= start:
            chosen = DecodeLaunch(*launch)
    return chosen
