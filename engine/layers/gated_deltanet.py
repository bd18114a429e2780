"""Gated DeltaNet mixer (Qwen3.5's linear attention), a `RecurrentMixer`: decode rows take the recurrent update,
prefill rows the chunked gated delta rule, verify rows replay-then-run (`ops.gated_delta`).

Per token: q, k, v from a depthwise causal conv + SiLU over in_proj_qkv's output (the conv shared with Mamba2,
`ops.conv`), raw gates a, b from in_proj_a / in_proj_b (the ops make g = -exp(A_log) * softplus(a + dt_bias) and
beta = sigmoid(b), and L2-normalise q and k), then the output's per-head RMSNorm times silu(z) (norm before gate,
`ops.norm.reference.norm_gate_reference`) and out_proj.

Its state per slot and layer: the conv window [conv_dim, K-1] (model dtype) and the recurrent state [Hv, Dk, Dv]
(state dtype); its verify inputs per position: the conv input [conv_dim] and the conv's k [Hk, Dk] and v [Hv, Dv]
with the raw gates a, b [Hv].
"""

from __future__ import annotations

import torch
from torch import nn

from baton.engine.config import ModelConfig
from baton.engine.forward_batch import ForwardBatch
from baton.engine.layers.fused_linears import fuse_weights, fused_weight
from baton.engine.layers.norms import NormGate, PendingNorm
from baton.engine.layers.project import project
from baton.engine.layers.recurrent_mixer import RecurrentMixer, States
from baton.engine.state_spec import STATE_DTYPE, StateSpec, StateTensor


class GatedDeltaNetMixer(RecurrentMixer):
    def __init__(self, cfg: ModelConfig, state_index: int) -> None:
        super().__init__(state_index)
        self.num_k_heads, self.num_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim, self.conv_dim = cfg.gdn_key_dim, cfg.gdn_value_dim, cfg.gdn_conv_dim
        self.chunk_size = cfg.chunk_size
        h = cfg.hidden_size
        self.in_proj_qkv = nn.Linear(h, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(h, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(h, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(h, self.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, cfg.conv_kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.norm = NormGate(self.head_v_dim, cfg.layer_norm_epsilon)
        self.out_proj = nn.Linear(self.value_dim, h, bias=False)
        self._in_w: torch.Tensor | None = None  # the fused input projections' weight (`fuse`)

    @classmethod
    def state_spec(cls, cfg: ModelConfig, num_layers: int) -> StateSpec:
        hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                          cfg.linear_value_head_dim)
        return StateSpec(
            num_layers=num_layers,
            states=(StateTensor("conv", (cfg.gdn_conv_dim, cfg.conv_kernel - 1), segments=(  # q | k | v
                        cfg.gdn_key_dim, cfg.gdn_key_dim, cfg.gdn_value_dim)),
                    StateTensor("ssm", (hv, dk, dv), STATE_DTYPE)),
            verify_inputs=(StateTensor("conv", (cfg.gdn_conv_dim,)), StateTensor("k", (hk, dk)),
                           StateTensor("v", (hv, dv)), StateTensor("a", (hv,)), StateTensor("b", (hv,))))

    def _in_parts(self) -> tuple[nn.Module, ...]:
        # u (what the rows' ops take: the conv's input, then the raw gates a, b) and then z, in one output.
        return self.in_proj_qkv, self.in_proj_a, self.in_proj_b, self.in_proj_z

    def fuse(self) -> None:
        """The four input projections as one GEMM (`fused_linears`)."""
        self._in_w = fuse_weights(self._in_parts())

    def _fused(self) -> torch.Tensor | None:
        return fused_weight(self._in_parts(), self._in_w)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, keep: torch.Tensor | None = None) -> torch.Tensor:
        """The mixer's output [T, hidden]; with `keep`, only those tokens' (the states are written for all)."""
        w = self._fused()
        if w is None:
            u = torch.cat([self.in_proj_qkv(x), self.in_proj_a(x), self.in_proj_b(x)], dim=-1)
            return self._mix(u, self.in_proj_z(x), batch, keep)
        return self._mix(*self._split_in(nn.functional.linear(x, w)), batch, keep)

    def forward_pending(self, p: PendingNorm, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Few-token steps: the block's add + norm run in the input projections' GEMV."""
        w = self._fused()
        if w is None:
            x, residual = p.materialize()
            return self.forward(x, batch), residual
        y, residual = p.linear(w)
        return self._mix(*self._split_in(y), batch), residual

    def _split_in(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused projections' output -> u, z (views: the ops take row strides)."""
        return y.split([self.conv_dim + 2 * self.num_v_heads, self.value_dim], dim=-1)

    def _mix(self, u: torch.Tensor, z: torch.Tensor, batch: ForwardBatch, keep: torch.Tensor | None = None
             ) -> torch.Tensor:
        o = self.run_rows(u, batch)  # [T, Hv, Dv]
        if keep is not None:
            o, z = o[keep], z[keep]
        t = o.shape[0]
        o = self.norm(o.reshape(t * self.num_v_heads, self.head_v_dim), z.reshape(t * self.num_v_heads, self.head_v_dim))
        return project(self.out_proj, o.reshape(t, self.value_dim).to(z.dtype), batch, self.kernels)

    def _split_u(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return u.split([self.conv_dim, self.num_v_heads, self.num_v_heads], dim=-1)

    def _split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv's output [..., conv_dim] -> q, k [..., Hk, Dk] and v [..., Hv, Dv]."""
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        lead = qkv.shape[:-1]
        return (q.reshape(*lead, self.num_k_heads, self.head_k_dim), k.reshape(*lead, self.num_k_heads, self.head_k_dim),
                v.reshape(*lead, self.num_v_heads, self.head_v_dim))

    def decode(self, u: torch.Tensor, states: States, batch: ForwardBatch) -> torch.Tensor:
        """o [Rd, Hv, Dv]."""
        (conv_state, ssm_state), slots = states, batch.state_slots[:batch.num_decodes]
        qkv, a, b = self._split_u(u)
        q, k, v = self._split_qkv(self.kernels.conv_update(qkv, self.conv1d.weight.squeeze(1), None, conv_state, slots))
        return self.kernels.gated_delta_decode(ssm_state, q, k, v, a, b, self.A_log, self.dt_bias, slots)

    def prefill(self, u: torch.Tensor, states: States, batch: ForwardBatch, query_start_loc: torch.Tensor,
                slots: torch.Tensor, has_initial_state: torch.Tensor) -> torch.Tensor:
        """o [Tp, Hv, Dv]."""
        conv_state, ssm_state = states
        qkv, a, b = self._split_u(u)
        qkv = self.kernels.conv_varlen(qkv, self.conv1d.weight.squeeze(1), None, conv_state, query_start_loc, slots,
                                       has_initial_state)
        q, k, v = self._split_qkv(qkv)
        return self.kernels.gated_delta_prefill(ssm_state, q, k, v, a, b, self.A_log, self.dt_bias, query_start_loc,
                                                slots, has_initial_state, self.chunk_size)

    def verify(self, u: torch.Tensor, states: States, inputs: States, batch: ForwardBatch) -> torch.Tensor:
        """Replay each row's accepted positions of its last verify, run its 1+k tokens from there and record their
        inputs (R3/R4). o of the decode tokens [ndt, Hv, Dv]."""
        conv_state, ssm_state = states
        rec_conv, rec_k, rec_v, rec_a, rec_b = inputs
        nd = batch.num_decodes
        idx = batch.spec_token_index  # [Rd, T]
        rows_t = idx.shape[1]
        slots, replay, ntok = batch.state_slots[:nd], batch.spec_replay, batch.spec_num_tokens
        rows = u[:nd * rows_t].view(nd, rows_t, -1) if batch.spec_uniform else u[idx]
        qkv, a, b = self._split_u(rows)
        qkv = self.kernels.conv_update_verify(qkv, self.conv1d.weight.squeeze(1), None, conv_state, rec_conv, slots,
                                              replay, ntok)
        q, k, v = self._split_qkv(qkv)
        o = self.kernels.gated_delta_verify(ssm_state, rec_k, rec_v, rec_a, rec_b, q, k, v, a, b, self.A_log,
                                            self.dt_bias, slots, replay, ntok)  # [Rd, T, Hv, Dv]
        o = o.reshape(nd * rows_t, self.num_v_heads, self.head_v_dim)
        return o if batch.spec_uniform else o[batch.spec_flat_index]
