"""Tuning of the speculative-sampling kernels, each entry with its reason. Numbers and their history:
benchmarks/RESULTS.md."""

# Vocabulary entries a program reads at a time: wide tiles keep the pass over V to few iterations.
BLOCK = 4096
# Programs a row at most (the `_share` tile's rows): past that, combining the splits costs more than it spreads.
MAX_SPLITS = 32
# Rows of [*, V] the reference computes a filtered distribution for at a time: its sort and float32 copies then take
# a bounded share of memory whatever the batch, also inside a CUDA graph's memory pool.
FILTER_ROWS = 32
