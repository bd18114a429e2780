"""Logits processing in one pass over the vocabulary per processed (row, position): grammar mask, logit_bias,
min_tokens' stop mask, the repetition / frequency / presence penalties, then min_p's mask in a light second pass.
The torch reference is `engine.logits_processing.apply_processing`; `kernel.py` holds the Triton kernels, which give
the same float32 logits.
"""
