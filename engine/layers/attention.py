"""NemotronH attention: GQA, no positional embedding (position comes from the Mamba layers), paged KV."""

from __future__ import annotations

import torch
from torch import nn

from baton.engine.config import ModelConfig
from baton.engine.forward_batch import ForwardBatch
from baton.engine.ops import dispatch


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, kv_index: int) -> None:
        super().__init__()
        self.kv_index = kv_index  # which KV pool layer this attention layer owns
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)     # [T, Hq, D]
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        kv_cache = batch.kv_caches[self.kv_index]
        dispatch.write_kv(k)(k, v, kv_cache, batch.slot_mapping)
        meta = {} if batch.attention_meta is None else {"attention_meta": batch.attention_meta}
        out = dispatch.paged_attention(q)(q, kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables,
                                          self.scale, **meta)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))
