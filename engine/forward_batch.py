"""The metadata of one forward pass, handed down to every layer (a scoped context, no module globals).

Rows are ordered decode rows first, then prefill rows; tokens of all rows are concatenated ("varlen").
Built only by the runner; all index tensors live on the model's device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    num_decodes: int                  # decode rows come first, one token each
    query_start_loc: torch.Tensor     # [R+1] int64: row r owns tokens qsl[r]:qsl[r+1]
    seq_lens: torch.Tensor            # [R] int64: context + this step's tokens
    block_tables: torch.Tensor        # [R, max_blocks] int64 (padded)
    slot_mapping: torch.Tensor        # [T] int64: flat KV slot (block * block_size + offset) per token
    state_slots: torch.Tensor         # [R] int64: Mamba state slot per row
    has_initial_state: torch.Tensor   # [R] bool: False rows start from a zero state (R2)
    kv_caches: list[torch.Tensor]     # per attention layer: [num_blocks, 2, block_size, Hkv, D]
    conv_states: list[torch.Tensor]   # per Mamba layer: [slots, conv_dim, K-1]
    ssm_states: list[torch.Tensor]    # per Mamba layer: [slots, H, P, N]

    @property
    def num_decode_tokens(self) -> int:
        # One token per decode row (speculative verify rows come with the MTP issue #5).
        return self.num_decodes

    @property
    def num_rows(self) -> int:
        return self.state_slots.shape[0]
