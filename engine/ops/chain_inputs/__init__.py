"""The inputs of a verify step chained on the one before it, built on the device from that step's packed results
(no host read between the two). `reference.py` holds the torch reference, `kernel.py` the Triton kernel.
"""
