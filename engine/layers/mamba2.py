"""Mamba2 mixer over a varlen batch: decode rows take the state-update path, prefill rows the chunked scan.

Which path a row takes is decided by the scheduler from computed tokens (`ForwardBatch.num_decodes`),
never from its query length (R2). Prefill rows whose `has_initial_state` is False start from zeros:
their pool slot's old contents are never read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from baton.engine.config import ModelConfig
from baton.engine.forward_batch import ForwardBatch
from baton.engine.layers.norms import GatedRMSNorm
from baton.engine.layers.project import project
from baton.engine.ops.kernels import Kernels

if TYPE_CHECKING:
    from baton.engine.layers.norms import PendingNorm


class Mamba2Mixer(nn.Module):
    # This engine's implementation of each op, set once at load (`ops.kernels.bind_kernels`).
    kernels: Kernels | None = None

    def __init__(self, cfg: ModelConfig, state_index: int) -> None:
        super().__init__()
        self.state_index = state_index  # which state-pool layer this mixer owns
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
        zxbcdt, residual = p.linear(self.in_proj.weight, self.in_proj.bias)
        return self._mix(zxbcdt, batch), residual

    def _mix(self, zxbcdt: torch.Tensor, batch: ForwardBatch, keep: torch.Tensor | None = None) -> torch.Tensor:
        """in_proj's output -> the mixer's output (out_proj's)."""
        x = zxbcdt  # (its dtype and row count are the block input's)
        t = x.shape[0]
        gate, xbc, dt = zxbcdt.split([self.intermediate, self.conv_dim, self.num_heads], dim=-1)
        conv_state = batch.conv_states[self.state_index]  # [S, C, K-1]
        ssm_state = batch.ssm_states[self.state_index]    # [S, H, P, N]
        weight = self.conv1d.weight.squeeze(1)            # [C, K]
        if self.A is None:
            raise RuntimeError("Mamba2Mixer: freeze() after loading the weights, before the first forward")
        A = self.A
        nd = batch.num_decodes  # decode rows come first: their tokens are the first ndt
        ndt = batch.num_decode_tokens
        # y [T, H, P]: a batch of one kind takes its op's output as is; a mixed one is assembled by one copy.
        parts: list[torch.Tensor] = []

        if nd and batch.is_spec:
            parts.append(self._verify(xbc, dt, A, weight, conv_state, ssm_state, batch))
        elif nd:
            xbc_d = self.kernels.conv_update(xbc[:nd], weight, self.conv1d.bias, conv_state, batch.state_slots[:nd])
            xs, B, C = self._split_xbc(xbc_d)
            parts.append(self.kernels.state_update(ssm_state, xs, dt[:nd], A, B, C, self.D, self.dt_bias,
                                                   batch.state_slots[:nd], self.dt_min))
        if nd < batch.num_rows:
            # A batch without decode rows starts at 0: no offset to subtract.
            qsl = batch.query_start_loc if not nd else batch.query_start_loc[nd:] - batch.query_start_loc[nd]
            slots, init = batch.state_slots[nd:], batch.has_initial_state[nd:]
            xbc_p = self.kernels.conv_varlen(xbc[ndt:], weight, self.conv1d.bias, conv_state, qsl, slots, init)
            xs, B, C = self._split_xbc(xbc_p)
            meta = {} if batch.prefill_chunk_meta is None else {"chunk_meta": batch.prefill_chunk_meta}
            parts.append(self.kernels.chunk_scan(xs, dt[ndt:], A, B, C, self.D, self.dt_bias, qsl, ssm_state, slots,
                                                 init, self.chunk_size, self.dt_min, **meta))
        y = parts[0] if len(parts) == 1 else torch.cat(parts)
        y = y.reshape(t, self.intermediate)
        if keep is not None:
            if not keep.shape[0]:
                return x.new_empty(0, self.out_proj.out_features)
            y, gate = y[keep], gate[keep]
        y = self.norm(y, gate).to(x.dtype)
        return project(self.out_proj, y, batch, self.kernels)

    def _verify(self, xbc: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, weight: torch.Tensor,
                conv_state: torch.Tensor, ssm_state: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Verify rows: replay each row's accepted positions of its last verify into its state, run its 1+k
        tokens from there and record their inputs (R3/R4). Returns y of the decode tokens [ndt, H, P]."""
        nd = batch.num_decodes
        idx = batch.spec_token_index  # [Rd, T]
        rows_t = idx.shape[1]
        slots, replay, ntok = batch.state_slots[:nd], batch.spec_replay, batch.spec_num_tokens
        rec_conv, rec_x, rec_B, rec_dt = batch.verify_inputs[self.state_index]
        if batch.spec_uniform:  # (row, t) is token row * T + t: views, no gathers
            xbc_rows = xbc[:nd * rows_t].view(nd, rows_t, -1)
            dt_rows = dt[:nd * rows_t].view(nd, rows_t, -1)
        else:
            xbc_rows, dt_rows = xbc[idx], dt[idx]
        xbc_v = self.kernels.conv_update_verify(xbc_rows, weight, self.conv1d.bias, conv_state, rec_conv, slots,
                                                replay, ntok)
        xs, B, C = self._split_xbc(xbc_v.reshape(nd * rows_t, -1))
        y = self.kernels.state_update_verify(
            ssm_state, rec_x, rec_B, rec_dt, xs.view(nd, rows_t, self.num_heads, self.head_dim), dt_rows, A,
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
