"""Tuning of the relu2 kernel, each entry with its reason. Numbers and
their history: benchmarks/RESULTS.md."""

# Elements per program: a wide block keeps this memory-bound launch to few programs.
BLOCK = 1024
