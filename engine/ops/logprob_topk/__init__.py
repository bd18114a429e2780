"""A step's logprob rows (`logprobs.pack`: the chosen token's logprob and the top-k alternatives of each row) in
two launches over the logits, without the [L, V] float32 log-softmax and the top-k over it that the torch reference
(`engine.logprobs.pack`) makes. `kernel.py` holds the Triton kernels.
"""
