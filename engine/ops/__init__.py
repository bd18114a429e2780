"""Batched varlen operators with torch references (the CPU path and the tests' ground truth)."""
