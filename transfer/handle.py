"""`TransferHandle`: what the prefill node returns for a finished prefill, and the decode node needs to pull it."""

from __future__ import annotations

import msgspec


class TransferHandle(msgspec.Struct, frozen=True):
    engine_id: str                   # the prefill engine (its side channel serves its AgentMetadata)
    agent_name: str                  # its NIXL agent, to detect a restarted peer behind the same id
    request_id: str
    num_tokens: int                  # tokens computed on the prefill side (N-1 for an N-token prompt)
    kv_block_ids: tuple[int, ...]    # remote KV blocks, in position order
    state_slot: int                  # remote state slot (every state pool)
    lease_expiry: float              # unix time after which the prefill side frees them
    lease_id: str                    # random per lease: renewals name it
