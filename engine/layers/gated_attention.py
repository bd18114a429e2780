"""Qwen3.5's gated attention: GQA over the paged KV cache with per-head RMSNorm of q and k, partial RoPE, and an
output gate: out = o_proj(attention(q, k, v) * sigmoid(gate)).

q_proj yields, per head, its D queries followed by its D gate channels (HF `Qwen3_5Attention`). The norms' weights
are `RMSNorm`s whose zero-centred offsets were folded at load (`CausalLM`); the positions are the batch's
(`ForwardBatch.positions`, set by the model at the start of each forward). After `fuse()` q/k/v run as one GEMM
(`fused_linears`), in few-token steps with the block's norm in it (`forward_pending`).
"""

from __future__ import annotations

import torch
from torch import nn

from baton.engine.config import ModelConfig
from baton.engine.forward_batch import ForwardBatch
from baton.engine.layers.fused_linears import fuse_weights, fused_weight
from baton.engine.layers.norms import PendingNorm, RMSNorm
from baton.engine.layers.project import project
from baton.engine.ops.kernels import Kernels
from baton.engine.ops.rope.reference import rope_inv_freq


class GatedAttention(nn.Module):
    # This engine's implementation of each op, set once at load (`ops.kernels.bind_kernels`).
    kernels: Kernels | None = None
    # This layer's [2] fp32 (K, V) scales of an FP8 KV pool, a row of the engine's table (`kv_cache_dtype`); None
    # for a pool in the model dtype.
    kv_scale: torch.Tensor | None = None

    def __init__(self, cfg: ModelConfig, kv_index: int) -> None:
        super().__init__()
        self.kv_index = kv_index  # which KV pool layer this attention layer owns
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        d, h = cfg.head_dim, cfg.hidden_size
        self.q_proj = nn.Linear(h, 2 * self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.layer_norm_epsilon)
        self.k_norm = RMSNorm(d, cfg.layer_norm_epsilon)
        self.rope_theta, self.rotary_dim = cfg.rope_theta, cfg.rotary_dim
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", rope_inv_freq(cfg.rope_theta, cfg.rotary_dim), persistent=False)
        self._qkv: torch.Tensor | None = None  # the fused q/k/v weight (`fuse`)

    def place_rope(self) -> None:
        """The inverse frequencies on the weights' device: loading assigns the weights and leaves buffers where
        construction put them."""
        self.inv_freq = rope_inv_freq(self.rope_theta, self.rotary_dim, self.q_proj.weight.device)

    def fuse(self) -> None:
        """q_proj, k_proj, v_proj as one GEMM (`fused_linears`)."""
        self._qkv = fuse_weights((self.q_proj, self.k_proj, self.v_proj))

    def _fused(self) -> torch.Tensor | None:
        return fused_weight((self.q_proj, self.k_proj, self.v_proj), self._qkv)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, keep: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output [T, hidden]; with `keep`, only those tokens' (the KV cache is written for all)."""
        w = self._fused()
        if w is None:
            return self._attend(self.q_proj(x), self.k_proj(x), self.v_proj(x), batch, keep)
        return self._attend(*self._split(nn.functional.linear(x, w)), batch, keep)

    def forward_pending(self, p: PendingNorm, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Few-token steps: the block's add + norm run in the q/k/v GEMV."""
        w = self._fused()
        if w is None:
            x, residual = p.materialize()
            return self.forward(x, batch), residual
        qkv, residual = p.linear(w)
        return self._attend(*self._split(qkv), batch), residual

    def _split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        nq, nkv = 2 * self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return qkv.split([nq, nkv, nkv], dim=-1)

    def _attend(self, qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        t, hq, hk, d = qg.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qg = qg.reshape(t, hq, 2 * d)
        gate = qg[..., d:].reshape(t, hq * d)
        q = self.q_norm(qg[..., :d].reshape(t * hq, d)).view(t, hq, d)
        k = self.k_norm(k.reshape(t * hk, d)).view(t, hk, d)
        v = v.reshape(t, hk, d)
        if batch.positions is None:
            raise RuntimeError("GatedAttention: the model sets ForwardBatch.positions before its layers run")
        q, k = self.kernels.rope(q, k, batch.positions, self.inv_freq)
        kv_cache = batch.kv_caches[self.kv_index]
        fp8 = {} if self.kv_scale is None else {"kv_scale": self.kv_scale}
        self.kernels.write_kv(k, v, kv_cache, batch.slot_mapping, **fp8)
        meta = {} if batch.attention_meta is None else {"attention_meta": batch.attention_meta}
        meta.update(fp8)
        out = self.kernels.paged_attention(q, kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables,
                                           self.scale, **meta)
        out = out.reshape(t, hq * d) * torch.sigmoid(gate)
        return project(self.o_proj, out if keep is None else out[keep], batch, self.kernels)
