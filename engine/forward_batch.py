"""The metadata of one forward pass, handed down to every layer (a scoped context, no module globals).

Rows are ordered decode rows first, then prefill rows; tokens of all rows are concatenated ("varlen").
Built only by the runner; all index tensors live on the model's device.

With speculative decoding a decode row is a verify row of 1+k tokens (its last token, k drafts). The
`spec_*` fields then lay the decode tokens out as [Rd, T] (T = 1 + the batch's largest k) for the verify
state ops, which first replay `spec_replay[b]` recorded positions of the row's last verify into its slot's
state (that count was decided on the device by the last verify, R3) and record this step's inputs in
`verify_inputs` (R4: nothing past the accepted positions ever reaches the state).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CheckpointRows:
    """The recurrent mixers' prefill sequences with checkpoint rows (`scheduler_output.CheckpointRow`) appended:
    each runs the first tokens of its prefill row again, into a lent slot. Indices count prefill tokens from 0."""
    token_index: torch.Tensor       # [E] int64: the prefill tokens the appended sequences run, in order
    query_start_loc: torch.Tensor   # [Rp+C+1] int64: the prefill rows', then the C appended sequences'
    state_slots: torch.Tensor       # [Rp+C] int64
    has_initial_state: torch.Tensor  # [Rp+C] bool


@dataclass
class ForwardBatch:
    num_decodes: int                  # decode rows come first
    query_start_loc: torch.Tensor     # [R+1] int64: row r owns tokens qsl[r]:qsl[r+1]
    seq_lens: torch.Tensor            # [R] int64: context + this step's tokens
    block_tables: torch.Tensor        # [R, max_blocks] int64 (padded)
    slot_mapping: torch.Tensor        # [T] int64: flat KV slot (block * block_size + offset) per token
    state_slots: torch.Tensor         # [R] int64: recurrent state slot per row
    has_initial_state: torch.Tensor   # [R] bool: False rows start from a zero state (R2)
    kv_caches: list[torch.Tensor]     # per attention layer: [num_blocks, 2, block_size, Hkv, D]
    # per recurrent mixer layer: its declared states, each [slots, *shape] (`CachePools.state_layers`)
    mixer_states: list[tuple[torch.Tensor, ...]]
    num_decode_tokens: int = -1       # tokens of the decode rows (-1: one per row)
    spec_num_tokens: torch.Tensor | None = None    # [Rd] int64: 1 + k per verify row
    spec_replay: torch.Tensor | None = None        # [Rd] int64: recorded positions to replay first
    spec_token_index: torch.Tensor | None = None   # [Rd, T] int64: flat token of (row, t), clamped to the row
    spec_flat_index: torch.Tensor | None = None    # [decode tokens] int64: (row, t) -> row * T + t
    # Every verify row holds all T tokens, row b's at b * T + t: the two index maps above are the identity, and
    # their users take views instead of gathers (always so in a CUDA graph's step).
    spec_uniform: bool = False
    # per recurrent mixer layer: its declared verify inputs, each [slots, 1+K, *shape] (`CachePools.verify_layers`)
    verify_inputs: list[tuple[torch.Tensor, ...]] | None = None
    # The recurrent mixer's prefill metadata (`RecurrentMixer.prefill_meta`; Mamba2's Triton chunk layout), built
    # from host ints by the runner so that the mixer never reads query_start_loc back; None: it needs none.
    prefill_chunk_meta: object | None = None
    # Checkpoints taken inside prefill chunks (None: none this step); `prefill_chunk_meta` then lays out the
    # prefill rows and the appended sequences together.
    checkpoint_rows: CheckpointRows | None = None
    # The attention kernel's program mapping for this batch (`ops.attention.kernel.AttentionMeta`), built once
    # per step from host ints by the runner instead of on the device by every attention layer; None: built there.
    attention_meta: object | None = None
    # Run the linear layers as GEMVs with the op before each fused in (`layers.norms.PendingNorm`,
    # `ops.linear.reference`): set by the runner for steps of few tokens (EngineConfig.fused_gemv_max_tokens).
    fused_gemv: bool = False
    # Each token's position [T] int64, for models with rotary embeddings: set by the model at the start of each
    # forward, on the device from query_start_loc and seq_lens (`ops.rope.reference.token_positions`), so that a
    # batch whose buffers a graph refills in place never carries another step's positions.
    positions: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.num_decode_tokens < 0:
            self.num_decode_tokens = self.num_decodes

    @property
    def is_spec(self) -> bool:
        return self.spec_replay is not None

    @property
    def num_rows(self) -> int:
        return self.state_slots.shape[0]
