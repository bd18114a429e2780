"""Tuning of the chained-verify inputs kernel, each entry with its reason. Numbers and
their history: benchmarks/RESULTS.md."""

# Rows per program (padding rows included): one tile holds a decode graph's rows in few programs.
ROWS = 32
