"""A recurrent mixer: a layer with per-request state in the state pools, run per row kind.

Invariants: the mixer declares its per-slot state and verify inputs (`state_spec`), and the pools, transfer and
spec replay use only that declaration. Which entry point a row takes is decided by the scheduler from computed
tokens (`ForwardBatch.num_decodes`, decode rows first), never from its query length (R2): decode rows take
`decode`, verify rows (with speculative decoding) `verify`, prefill rows `prefill`. Prefill rows whose
`has_initial_state` is False start from zeros: their slot's old contents are never read. `verify` first replays
each row's accepted positions of its last verify from its recorded inputs, then records this step's (R3/R4).
Checkpoint rows (`ForwardBatch.checkpoint_rows`) are more prefill sequences, appended to the prefill rows.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from baton.engine.config import ModelConfig
from baton.engine.forward_batch import ForwardBatch
from baton.engine.ops.kernels import Kernels
from baton.engine.state_spec import StateSpec

States = tuple[torch.Tensor, ...]  # one layer's declared states (or verify inputs), in declared order


class RecurrentMixer(nn.Module, ABC):
    # This engine's implementation of each op, set once at load (`ops.kernels.bind_kernels`).
    kernels: Kernels | None = None

    def __init__(self, state_index: int) -> None:
        super().__init__()
        self.state_index = state_index  # which state-pool layer this mixer owns

    @classmethod
    @abstractmethod
    def state_spec(cls, cfg: ModelConfig, num_layers: int) -> StateSpec:
        """The per-slot state and verify inputs of `num_layers` layers of this mixer under `cfg`."""

    @classmethod
    def prefill_meta(cls, cfg: ModelConfig, starts: list[int], kernels: Kernels, device: torch.device
                     ) -> object | None:
        """Host-built metadata of the prefill rows (query starts `starts`, from 0) for `prefill` with `kernels`, on
        `device` (`ForwardBatch.prefill_chunk_meta`); None: the mixer needs none."""
        return None

    @classmethod
    def graph_prefill_meta_ints(cls, meta: object, num_tokens: int) -> list[int]:
        """Host ints that turn `meta`, built for one prefill row of a mixed graph's padded Q tokens, into that row's
        metadata for its `num_tokens` real ones (`load_graph_prefill_meta` writes them, on the device)."""
        return []

    @classmethod
    def load_graph_prefill_meta(cls, meta: object, ints: torch.Tensor) -> None:
        """Write `graph_prefill_meta_ints`' ints, copied to the device, into `meta`'s tensors in place."""

    @abstractmethod
    def decode(self, u: torch.Tensor, states: States, batch: ForwardBatch) -> torch.Tensor:
        """The decode rows' one token each: u [Rd, ...] -> outputs [Rd, ...], the rows' states advanced."""

    @abstractmethod
    def prefill(self, u: torch.Tensor, states: States, batch: ForwardBatch, query_start_loc: torch.Tensor,
                slots: torch.Tensor, has_initial_state: torch.Tensor) -> torch.Tensor:
        """The prefill rows' tokens (varlen, `query_start_loc` from 0): u [Tp, ...] -> outputs [Tp, ...], each
        row's final state in its slot."""

    @abstractmethod
    def verify(self, u: torch.Tensor, states: States, inputs: States, batch: ForwardBatch) -> torch.Tensor:
        """The verify rows' tokens: replay, run and record (module docstring) -> outputs [decode tokens, ...]."""

    def run_rows(self, u: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Per-token inputs u [T, ...] of the whole batch -> per-token outputs [T, ...], each row kind through its
        entry point."""
        states = batch.mixer_states[self.state_index]
        nd, ndt = batch.num_decodes, batch.num_decode_tokens
        # A batch of one kind takes its entry point's output as is; a mixed one is assembled by one copy.
        parts: list[torch.Tensor] = []
        if nd and batch.is_spec:
            parts.append(self.verify(u[:ndt], states, batch.verify_inputs[self.state_index], batch))
        elif nd:
            parts.append(self.decode(u[:nd], states, batch))
        ext = batch.checkpoint_rows
        if nd < batch.num_rows and ext is not None:
            # The appended sequences' outputs are dropped: only the states they leave in their lent slots count.
            up = u[ndt:]
            y = self.prefill(torch.cat([up, up[ext.token_index]]), states, batch, ext.query_start_loc,
                             ext.state_slots, ext.has_initial_state)
            parts.append(y[:up.shape[0]])
        elif nd < batch.num_rows:
            # A batch without decode rows starts at 0: no offset to subtract.
            qsl = batch.query_start_loc if not nd else batch.query_start_loc[nd:] - batch.query_start_loc[nd]
            parts.append(self.prefill(u[ndt:], states, batch, qsl, batch.state_slots[nd:],
                                      batch.has_initial_state[nd:]))
        return parts[0] if len(parts) == 1 else torch.cat(parts)
