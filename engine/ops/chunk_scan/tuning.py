"""Tuning of the chunked scan's launches (module constants, so that a sweep can set them), each entry with its
reason; each was picked by timing the whole scan on a GPU, and none changes the math: the outputs are bit-identical
across settings. Numbers and their history: benchmarks/RESULTS.md ("Prefill")."""

# State kernel's warps and stages: the fastest sequential chunk walk at the narrow block.
STATE_WARPS, STATE_STAGES = 4, 2
# State kernel's head-dim rows per program while the programs fit two waves' worth per SM (`STATE_PROGRAMS_PER_SM`).
STATE_BLOCK_P = 32
# A row's chunks are walked one after another, so a second wave of state programs doubles the walk: past
# STATE_PROGRAMS_PER_SM programs per SM at STATE_BLOCK_P the wide block takes over, half as many programs.
STATE_BLOCK_P_WIDE = 64
# Programs per SM of the narrow block before the wide one is taken (rows x H x P / STATE_BLOCK_P x N / 128 <= this x SMs).
STATE_PROGRAMS_PER_SM = 2
# The wide block with more warps and stages walks a row fastest, but its shared memory holds one program per SM: taken
# only while the rows' wide programs fit on the GPU at once.
STATE_ONE_WAVE_WARPS, STATE_ONE_WAVE_STAGES = 8, 3
# C^T B kernel's warps and stages: the fastest for its small per-chunk products.
CB_WARPS, CB_STAGES = 4, 2
# Output kernel's warps and stages: it is latency-bound, a single stage keeps more programs resident.
OUTPUT_WARPS, OUTPUT_STAGES = 4, 1
# Register cap per thread of the output kernel, which then fits one more program per SM with the same bits; None: no cap.
OUTPUT_MAXNREG = 128
# True: the state kernel computes its chunks' starts from the row's first (affine addresses) instead of loading each
# chunk's from the metadata: same chunks, same bits, fewer loads on the sequential walk.
STATE_AFFINE = True
# The output kernel's factored in-chunk decay is taken for a block of chunk positions whose running sums of dt * A
# span at most this much (its factors then stay below exp(FACTOR_RANGE / 2)), else the exact per-entry exp; a
# negative value turns the factored path off.
FACTOR_RANGE = 60.0
# The dt launch's block of heads (contiguous in dt's rows) and warps: the block size hardly matters for this small launch.
DT_BLOCK_H, DT_WARPS = 16, 4
