"""Tuning of the paged attention and KV-write kernels, each entry with its reason. Numbers and
their history: benchmarks/RESULTS.md."""

# Query rows (queries x group heads) per prefill program, its key tile, warps and software-pipeline stages: the
# fastest causal prefill at the 8b-like layer over long, medium and mixed rows (`benchmarks/RESULTS.md`).
PREFILL_BLOCK_M, PREFILL_BLOCK_N, PREFILL_WARPS, PREFILL_STAGES = 128, 64, 8, 2
# Query tiles of at most this many rows (queries x group heads) that are not decode tiles, e.g. a verify step's rows
# of 1+K queries, run as decode tiles do: 4 warps, DECODE_STAGES, split-K when they are few, because the prefill
# tile leaves most of its rows empty and the GPU idle for so few queries.
SHORT_BLOCK_M = 32
# Decode batches of at least this many rows walk their keys in tiles of 128 instead of 64: the wider tile shortens
# large decode steps and does not help small ones (timed in whole steps by `benchmarks/launch_probe.py`).
WIDE_DECODE_ROWS = 40
# Software-pipeline stages of the key loop for decode tiles (BLOCK_Q 1): fewer than Triton's default 3 is faster for
# their short, memory-bound loop. Other tiles keep 3.
DECODE_STAGES = 2
# Split-K aims at this many decode (short) programs per SM (`_auto_splits`); more splits cost more in combining
# partials than they gain in occupancy at serving batch sizes.
SPLIT_PROGRAMS_PER_SM = 2
# Elements of a token's K (or V) row per KV-write program: a wide block keeps this copy to few programs.
KV_WRITE_BLOCK = 1024
