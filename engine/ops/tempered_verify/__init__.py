"""Speculative verification's decisions: greedy rows by the argmax, stochastic rows by speculative sampling at a
temperature, with or without top-k / top-p, every draw from counter-based noise of the row's seed and position.
`reference.py` holds the torch references, `kernel.py` the Triton kernels, which decide the same tokens.
"""
