"""Mixed-step graphs at several prompt-chunk sizes: a step replays the smallest that holds its chunk.

A mixed-step graph (`mixed_graphs.MixedStepGraphs`) computes all of its Q padded prompt tokens whatever the chunk's
real length, and a prompt's last chunk, or a short prompt whole, is usually far shorter than Q. So the engine keeps graphs for the chunk sizes Q, Q/4, Q/16, ...
down to MIN_BUCKET_TOKENS (`bucket_sizes`), each bucket its own static inputs and chunk layout, all captured into one
memory pool (a step replays one graph at a time), and a step replays the smallest bucket >= its chunk's length.
Buckets below MIN_BUCKET_TOKENS are not kept: each would add a capture per decode size for almost no step time.
"""

from __future__ import annotations

import torch

from baton.engine.cache_pools import CachePools
from baton.engine.causal_lm import CausalLM
from baton.engine.mixed_graphs import DecodeRows, MixedStepGraphs, PromptChunk

MIN_BUCKET_TOKENS = 32
BUCKET_STEP = 4  # each bucket a quarter of the next


def bucket_sizes(chunk_tokens: int) -> tuple[int, ...]:
    """Q, Q // 4, Q // 16, ... while at least MIN_BUCKET_TOKENS (Q itself always), ascending."""
    if chunk_tokens < 1:
        raise ValueError(f"mixed step graphs: expected chunk_tokens >= 1, got {chunk_tokens}")
    sizes = [chunk_tokens]
    while sizes[-1] // BUCKET_STEP >= MIN_BUCKET_TOKENS:
        sizes.append(sizes[-1] // BUCKET_STEP)
    return tuple(sorted(sizes))


class MixedGraphBuckets:
    """`MixedStepGraphs` for each chunk size of `buckets` (default `bucket_sizes(chunk_tokens)`; the largest must be
    chunk_tokens); the same `run` / `capture_all` / `size_for` as one of them."""

    def __init__(self, model: CausalLM, pools: CachePools, block_size: int, max_rows: int,
                 max_blocks: int, device: torch.device, chunk_tokens: int,
                 buckets: tuple[int, ...] | None = None) -> None:
        sizes = bucket_sizes(chunk_tokens) if buckets is None else tuple(sorted(set(buckets)))
        if not sizes or sizes[0] < 1 or sizes[-1] != chunk_tokens:
            raise ValueError(f"mixed step graphs: expected chunk sizes in 1..{chunk_tokens}, the largest "
                             f"{chunk_tokens}, got {buckets}")
        self.Q = chunk_tokens
        self.started: torch.cuda.Event | None = None  # the last run's start mark (`pending_step.device_mark`)
        pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.buckets = {q: MixedStepGraphs(model, pools, block_size, max_rows, max_blocks, device, q, pool=pool)
                        for q in sizes}
        self.sizes = self.buckets[chunk_tokens].sizes  # decode-row counts, the same in every bucket

    def size_for(self, rows: int) -> int | None:
        return self.buckets[self.Q].size_for(rows)

    def bucket_for(self, chunk_len: int) -> int:
        """The smallest chunk size that holds `chunk_len` tokens (1 <= chunk_len <= Q)."""
        if not 1 <= chunk_len <= self.Q:
            raise ValueError(f"mixed step graphs: expected a chunk of 1..{self.Q} tokens, got {chunk_len}")
        return next(q for q in self.buckets if q >= chunk_len)

    @property
    def num_graphs(self) -> int:
        """Graphs captured so far, over every bucket."""
        return sum(len(g.graphs) for g in self.buckets.values())

    def capture_all(self) -> int:
        """Capture every bucket's every size now (largest bucket first); returns how many were captured."""
        return sum(self.buckets[q].capture_all() for q in sorted(self.buckets, reverse=True))

    def run(self, dec: DecodeRows, chunk: PromptChunk, fill: tuple | None = None) -> tuple[torch.Tensor, int]:
        """`MixedStepGraphs.run` on the smallest bucket that holds the chunk (its start mark then `started`)."""
        graphs = self.buckets[self.bucket_for(len(chunk.ids))]
        out = graphs.run(dec, chunk, fill=fill)
        self.started = graphs.started
        return out
