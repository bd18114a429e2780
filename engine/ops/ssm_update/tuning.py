"""Tuning of the state-update kernels, each entry with its reason. Numbers and
their history: benchmarks/RESULTS.md."""

# Decode batches of at least this many rows run the state update with one warp per program, fewer with two.
ONE_WARP_ROWS = 34
# Elements per program of the verify inputs' record: a wide block keeps that copy to few programs.
RECORD_BLOCK = 1024
