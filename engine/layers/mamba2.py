"""Mamba2 mixer, a `RecurrentMixer`: decode rows take the state-update path, prefill rows the chunked scan,
verify rows the verify state ops.

Its state per slot and layer: the conv window [conv_dim, K-1] (model dtype) and the SSM state [H, P, N] (state
dtype); its verify inputs per position: the conv inputs [conv_dim] and the SSM's x [H, P], B [G, N] and raw
dt [H] (`ops/spec_state_update.py` replays them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from baton.engine.config import ModelConfig
from baton.engine.forward_batch import ForwardBatch
from baton.engine.layers.norms import GatedRMSNorm
from baton.engine.layers.project import project
from baton.engine.layers.recurrent_mixer import RecurrentMixer, States
from baton.engine.ops.kernels import Kernels
from baton.engine.state_spec import STATE_DTYPE, StateSpec, StateTensor

if TYPE_CHECKING:
    from baton.engine.layers.norms import PendingNorm


class Mamba2Mixer(RecurrentMixer):
    def __init__(self, cfg: ModelConfig, state_index: int) -> None:
        super().__init__(state_index)
        self.num_heads = cfg.mamba_num_heads
        self.head_dim = cfg.mamba_head_dim
        self.n_groups = cfg.n_groups
        self.d_state = cfg.ssm_state_size
        self.intermediate = cfg.mamba_intermediate_size
        self.conv_dim = cfg.conv_dim
        self.chunk_size = cfg.chunk_size
        self.dt_min = cfg.time_step_min
        self.in_proj = nn.Linear(cfg.hidden_size, self.intermediate + self.conv_dim + self.num_heads,
                                 bias=cfg.mamba_proj_bias)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, cfg.conv_kernel, groups=self.conv_dim,
                                bias=cfg.use_conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_heads))
        self.D = nn.Parameter(torch.empty(self.num_heads))
        self.norm = GatedRMSNorm(self.intermediate, self.intermediate // self.n_groups, cfg.layer_norm_epsilon)
        self.out_proj = nn.Linear(self.intermediate, cfg.hidden_size, bias=cfg.mamba_proj_bias)
        # -exp(A_log) in fp32, set once by `freeze()` after loading (a buffer: moves with the module).
        self.A: torch.Tensor | None
        self.register_buffer("A", None, persistent=False)

    @classmethod
    def state_spec(cls, cfg: ModelConfig, num_layers: int) -> StateSpec:
        h, p, g, n = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups, cfg.ssm_state_size
        return StateSpec(
            num_layers=num_layers,
            states=(StateTensor("conv", (cfg.conv_dim, cfg.conv_kernel - 1), segments=(  # x | B | C
                        cfg.mamba_intermediate_size, g * n, g * n)),
                    StateTensor("ssm", (h, p, n), STATE_DTYPE)),
            verify_inputs=(StateTensor("conv", (cfg.conv_dim,)), StateTensor("x", (h, p)),
                           StateTensor("B", (g, n)), StateTensor("dt", (h,))))

    @classmethod
    def prefill_meta(cls, cfg: ModelConfig, starts: list[int], kernels: Kernels, device: torch.device
                     ) -> object | None:
        """The Triton chunked scan's chunk layout (`ops.chunk_scan.kernel.ChunkMeta`); None on the reference path."""
        if not kernels.triton:
            return None
        from baton.engine.ops.chunk_scan.kernel import build_chunk_meta
        return build_chunk_meta(starts, cfg.chunk_size, device)

    @classmethod
    def graph_prefill_meta_ints(cls, meta: object, num_tokens: int) -> list[int]:
        """The chunk lengths of a row of `num_tokens` (0 past it), then its chunk count."""
        cs, n = meta.chunk_size, meta.num_chunks
        return [max(0, min(cs, num_tokens - c * cs)) for c in range(n)] + [-(-num_tokens // cs)]

    @classmethod
    def load_graph_prefill_meta(cls, meta: object, ints: torch.Tensor) -> None:
        meta.chunk_len.copy_(ints[:meta.num_chunks])
        meta.row_chunk[1] = ints[meta.num_chunks]

    def freeze(self) -> None:
        """Derive the per-step constants from the loaded weights (once, not in every step)."""
        self.A = -torch.exp(self.A_log.float())  # [H]

    def forward(self, x: torch.Tensor, batch: ForwardBatch, keep: torch.Tensor | None = None) -> torch.Tensor:
        """The mixer's output [T, hidden]; with `keep`, only those tokens' [len(keep), hidden] (the state and conv
        window are written for all)."""
        return self._mix(self.in_proj(x), batch, keep)

    def forward_pending(self, p: PendingNorm, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Few-token steps: the block's add + norm run in in_proj's GEMV. The gated norm stays a kernel of its own
        before out_proj's GEMV, because fused into it the group RMS over all channels would be recomputed by every
        program."""
        zxbcdt, residual = p.apply(self.in_proj)
        return self._mix(zxbcdt, batch), residual

    def _mix(self, zxbcdt: torch.Tensor, batch: ForwardBatch, keep: torch.Tensor | None = None) -> torch.Tensor:
        """in_proj's output -> the mixer's output (out_proj's)."""
        x = zxbcdt  # (its dtype and row count are the block input's)
        t = x.shape[0]
        if self.A is None:
            raise RuntimeError("Mamba2Mixer: freeze() after loading the weights, before the first forward")
        gate = zxbcdt[:, :self.intermediate]
        # The rows' ops take xBC | dt (a view): the gate is applied after them.
        y = self.run_rows(zxbcdt[:, self.intermediate:], batch)  # [T, H, P]
        y = y.reshape(t, self.intermediate)
        if keep is not None:
            if not keep.shape[0]:
                return x.new_empty(0, self.out_proj.out_features)
            y, gate = y[keep], gate[keep]
        y = self.norm(y, gate).to(x.dtype)
        return project(self.out_proj, y, batch, self.kernels)

    def _xbc_dt(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' per-token inputs xBC | dt -> xBC, dt (views)."""
        xbc, dt = u.split([self.conv_dim, self.num_heads], dim=-1)
        return xbc, dt

    def decode(self, u: torch.Tensor, states: States, batch: ForwardBatch) -> torch.Tensor:
        """y [Rd, H, P]."""
        (conv_state, ssm_state), nd = states, batch.num_decodes
        xbc, dt = self._xbc_dt(u)
        xbc_d = self.kernels.conv_update(xbc, self.conv1d.weight.squeeze(1), self.conv1d.bias, conv_state,
                                        batch.state_slots[:nd])
        xs, B, C = self._split_xbc(xbc_d)
        return self.kernels.state_update(ssm_state, xs, dt, self.A, B, C, self.D, self.dt_bias,
                                        batch.state_slots[:nd], self.dt_min)

    def prefill(self, u: torch.Tensor, states: States, batch: ForwardBatch, query_start_loc: torch.Tensor,
                slots: torch.Tensor, has_initial_state: torch.Tensor) -> torch.Tensor:
        """y [Tp, H, P]."""
        conv_state, ssm_state = states
        qsl, init = query_start_loc, has_initial_state
        xbc, dt = self._xbc_dt(u)
        xbc_p = self.kernels.conv_varlen(xbc, self.conv1d.weight.squeeze(1), self.conv1d.bias, conv_state, qsl, slots,
                                        init)
        xs, B, C = self._split_xbc(xbc_p)
        meta = {} if batch.prefill_chunk_meta is None else {"chunk_meta": batch.prefill_chunk_meta}
        return self.kernels.chunk_scan(xs, dt, self.A, B, C, self.D, self.dt_bias, qsl, ssm_state, slots, init,
                                      self.chunk_size, self.dt_min, **meta)

    def verify(self, u: torch.Tensor, states: States, inputs: States, batch: ForwardBatch) -> torch.Tensor:
        """Replay each row's accepted positions of its last verify into its state, run its 1+k tokens from there
        and record their inputs (R3/R4). y of the decode tokens [ndt, H, P]."""
        conv_state, ssm_state = states
        rec_conv, rec_x, rec_B, rec_dt = inputs
        xbc, dt = self._xbc_dt(u)
        nd = batch.num_decodes
        idx = batch.spec_token_index  # [Rd, T]
        rows_t = idx.shape[1]
        slots, replay, ntok = batch.state_slots[:nd], batch.spec_replay, batch.spec_num_tokens
        if batch.spec_uniform:  # (row, t) is token row * T + t: views, no gathers
            xbc_rows = xbc[:nd * rows_t].view(nd, rows_t, -1)
            dt_rows = dt[:nd * rows_t].view(nd, rows_t, -1)
        else:
            xbc_rows, dt_rows = xbc[idx], dt[idx]
        xbc_v = self.kernels.conv_update_verify(xbc_rows, self.conv1d.weight.squeeze(1), self.conv1d.bias,
                                                 conv_state, rec_conv, slots, replay, ntok)
        xs, B, C = self._split_xbc(xbc_v.reshape(nd * rows_t, -1))
        y = self.kernels.state_update_verify(
            ssm_state, rec_x, rec_B, rec_dt, xs.view(nd, rows_t, self.num_heads, self.head_dim), dt_rows, self.A,
            B.view(nd, rows_t, self.n_groups, self.d_state), C.view(nd, rows_t, self.n_groups, self.d_state),
            self.D, self.dt_bias, slots, replay, self.dt_min, ntok)  # [Rd, T, H, P]
        y = y.reshape(nd * rows_t, self.num_heads, self.head_dim)
        return y if batch.spec_uniform else y[batch.spec_flat_index]

    def _split_xbc(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        gn = self.n_groups * self.d_state
        xs, B, C = xbc.split([self.intermediate, gn, gn], dim=-1)
        n = xbc.shape[0]
        return (xs.reshape(n, self.num_heads, self.head_dim), B.reshape(n, self.n_groups, self.d_state),
                C.reshape(n, self.n_groups, self.d_state))
