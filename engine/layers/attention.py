"""NemotronH attention: GQA, no positional embedding (position comes from the Mamba layers), paged KV.

After `fuse_qkv()` q_proj / k_proj / v_proj are views of one [Hq*D + 2*Hkv*D, hidden] weight and the layer runs
one GEMM instead of three (`fused_linears`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from baton.engine.config import ModelConfig
from baton.engine.forward_batch import ForwardBatch
from baton.engine.layers.fused_linears import fuse_weights, fused_weight
from baton.engine.layers.project import project
from baton.engine.ops.kernels import Kernels

if TYPE_CHECKING:
    from baton.engine.layers.norms import PendingNorm


class Attention(nn.Module):
    # This engine's implementation of each op, set once at load (`ops.kernels.bind_kernels`).
    kernels: Kernels | None = None
    # This layer's [2] fp32 (K, V) scales of an FP8 KV pool, a row of the engine's table (`kv_cache_dtype`); None
    # for a pool in the model dtype.
    kv_scale: torch.Tensor | None = None

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
        self._qkv: torch.Tensor | None = None  # the fused weight, while q/k/v are its views

    def fuse_qkv(self) -> None:
        """Put q_proj, k_proj, v_proj's weights into one tensor and make them its views (`fused_linears`)."""
        self._qkv = fuse_weights((self.q_proj, self.k_proj, self.v_proj))

    def _fused(self) -> torch.Tensor | None:
        return fused_weight((self.q_proj, self.k_proj, self.v_proj), self._qkv)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, keep: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output [T, hidden]; with `keep`, only those tokens' [len(keep), hidden] (the KV cache is
        written for all)."""
        qkv_w = self._fused()
        if qkv_w is not None:
            return self._attend(*self._split(nn.functional.linear(x, qkv_w)), batch, keep)
        return self._attend(self.q_proj(x), self.k_proj(x), self.v_proj(x), batch, keep)

    def forward_pending(self, p: PendingNorm, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Few-token steps: the block's add + norm run in the q/k/v GEMV."""
        qkv_w = self._fused()
        if qkv_w is None:
            x, residual = p.materialize()
            return self.forward(x, batch), residual
        qkv, residual = p.linear(qkv_w)
        return self._attend(*self._split(qkv), batch), residual

    def _split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        nq, nkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return qkv.split([nq, nkv, nkv], dim=-1)  # views: the kernels take row strides

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        t = q.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)     # [T, Hq, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)
        kv_cache = batch.kv_caches[self.kv_index]
        fp8 = {} if self.kv_scale is None else {"kv_scale": self.kv_scale}
        self.kernels.write_kv(k, v, kv_cache, batch.slot_mapping, **fp8)
        meta = {} if batch.attention_meta is None else {"attention_meta": batch.attention_meta}
        meta.update(fp8)
        out = self.kernels.paged_attention(q, kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables,
                                           self.scale, **meta)
        out = out.reshape(t, self.num_heads * self.head_dim)
        return project(self.o_proj, out if keep is None else out[keep], batch, self.kernels)
