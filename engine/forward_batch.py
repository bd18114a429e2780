"""The metadata of one forward pass, handed down to every layer (a scoped context, no module globals).

Rows are ordered decode rows first, then prefill rows; tokens of all rows are concatenated ("varlen").
Built only by the runner; all index tensors live on the model's device.

With speculative decoding a decode row is a verify row of 1+k tokens (its last token, k drafts). The
`spec_*` fields then lay the decode tokens out as [Rd, T] (T = 1 + the batch's largest k) for the
multi-token state ops, which write the state after each position into its own slot of the row's group
(R4) and read the row's committed slot (`state_slots`, chosen on the device, R3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    num_decodes: int                  # decode rows come first
    query_start_loc: torch.Tensor     # [R+1] int64: row r owns tokens qsl[r]:qsl[r+1]
    seq_lens: torch.Tensor            # [R] int64: context + this step's tokens
    block_tables: torch.Tensor        # [R, max_blocks] int64 (padded)
    slot_mapping: torch.Tensor        # [T] int64: flat KV slot (block * block_size + offset) per token
    state_slots: torch.Tensor         # [R] int64: Mamba state slot per row
    has_initial_state: torch.Tensor   # [R] bool: False rows start from a zero state (R2)
    kv_caches: list[torch.Tensor]     # per attention layer: [num_blocks, 2, block_size, Hkv, D]
    conv_states: list[torch.Tensor]   # per Mamba layer: [slots, conv_dim, K-1]
    ssm_states: list[torch.Tensor]    # per Mamba layer: [slots, H, P, N]
    num_decode_tokens: int = -1       # tokens of the decode rows (-1: one per row)
    spec_num_tokens: torch.Tensor | None = None    # [Rd] int64: 1 + k per verify row
    spec_dst_slots: torch.Tensor | None = None     # [Rd, T] int64: the slot for the state after position t
    spec_token_index: torch.Tensor | None = None   # [Rd, T] int64: flat token of (row, t), clamped to the row
    spec_flat_index: torch.Tensor | None = None    # [decode tokens] int64: (row, t) -> row * T + t

    def __post_init__(self) -> None:
        if self.num_decode_tokens < 0:
            self.num_decode_tokens = self.num_decodes

    @property
    def is_spec(self) -> bool:
        return self.spec_dst_slots is not None

    @property
    def num_rows(self) -> int:
        return self.state_slots.shape[0]
