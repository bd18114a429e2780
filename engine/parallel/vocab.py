"""The vocabulary split across tensor-parallel ranks: each rank holds a contiguous range of embedding rows (and
lm_head rows), the last range padded with zero rows to the same length.

Invariants: rank r owns ids [r * per_rank, (r + 1) * per_rank), per_rank = ceil(vocab / tp); an embedding lookup
is the sum over ranks of each rank's rows for the ids it owns (zeros elsewhere), so exactly the one rank's row;
the logits are every rank's columns gathered in rank order, cut back to `vocab` (`CausalLM.logits`).
"""

from __future__ import annotations

import torch
from torch import nn

from baton.engine.parallel.group import TPGroup


def per_rank(vocab: int, tp: int) -> int:
    return -(-vocab // tp)


def shard_rows(t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """Rank `rank`'s rows of a [vocab, ...] table, zero-padded to `per_rank` rows."""
    n = per_rank(t.shape[0], tp)
    part = t[rank * n:(rank + 1) * n]
    if part.shape[0] == n:
        return part
    return torch.cat([part, part.new_zeros(n - part.shape[0], *t.shape[1:])])


class VocabParallelEmbedding(nn.Module):
    """An `nn.Embedding`'s lookup over this rank's rows (`weight` [per_rank, hidden]), summed over the ranks."""

    def __init__(self, vocab: int, hidden: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.rows = per_rank(vocab, tp.size)
        self.start = tp.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.rows)  # [T]
        out = nn.functional.embedding(torch.where(mine, local, 0), self.weight)  # [T, hidden]
        return self.tp.all_reduce(out.masked_fill(~mine[:, None], 0))


def swap_vocab_parallel(model: nn.Module, vocab: int, tp: TPGroup) -> None:
    """Replace `model`'s token embeddings by a `VocabParallelEmbedding` and its `lm_head` (if any) by a Linear of
    this rank's rows; run where the model was built (meta), before its weights load."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Embedding):
                setattr(parent, name, VocabParallelEmbedding(vocab, child.embedding_dim, tp))
            elif name == "lm_head" and isinstance(child, nn.Linear):
                setattr(parent, name, nn.Linear(child.in_features, per_rank(vocab, tp.size), bias=False))
