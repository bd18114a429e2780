"""Causal attention over the paged KV cache for prefill chunks and decode rows alike, and the write of a step's
own K and V into that cache.

`reference.py` holds the torch references (`paged_attention`, `write_kv`), `kernel.py` the attention kernel (and its
program map, `build_attention_meta`), `kernel_kv_write.py` the KV-write kernel. A step writes its K and V first,
then attends: query i of a row sees positions up to its own.
"""
