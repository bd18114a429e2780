"""Rotary position embedding of the first `rotary_dim` channels of each head. `reference.py` holds the torch
reference (and each token's position), `kernel.py` the Triton kernel with the same rounding points.
"""
