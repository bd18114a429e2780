"""Tuning of the logprob-rows kernels, each entry with its reason. Numbers and their history:
benchmarks/RESULTS.md."""

# Vocabulary ids per block: a multiple of the warps' lanes that keeps a block's loads wide.
BLOCK = 1024
# Programs per SM to aim for: the pass is memory-bound, so a small batch splits each row over V until the grid
# fills the GPU.
PROGRAMS_PER_SM = 2
# The most slices a row takes (the second launch merges their candidates: MAX_SPLITS * next_power_of_2(k)).
MAX_SPLITS = 64
# Fewest blocks per slice: a slice shorter than this spends more on its launch than on its data.
MIN_BLOCKS_PER_SPLIT = 4
# The most alternatives the kernels keep per row (a slice's candidates live in registers); more take the reference.
MAX_K = 64
