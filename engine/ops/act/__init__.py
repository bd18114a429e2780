"""The MLP's activation relu2 = relu(x)^2. `reference.py` holds the torch reference, `kernel.py` the Triton kernel;
the two agree bit for bit.
"""
