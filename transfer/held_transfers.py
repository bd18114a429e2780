"""Prefill side: finished prefills held under leases until the decode side has read them.

`hold` leases a request's blocks and slot and returns the `TransferHandle` for the decode node.
`poll` (call it every engine step) frees the resources of requests whose READ completed (NIXL
notification) and of leases that expired, through the `free` callback, and counts both.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from baton.transfer.agent import TransferAgent
from baton.transfer.handle import TransferHandle
from baton.transfer.lease import Lease, LeaseTable


class HeldTransfers:
    def __init__(self, agent: TransferAgent, leases: LeaseTable, free: Callable[[Lease], None]) -> None:
        self.agent = agent
        self.leases = leases
        self._free = free

    def hold(self, request_id: str, block_ids: tuple[int, ...], state_slot: int, num_tokens: int) -> TransferHandle:
        lease = self.leases.hold(request_id, block_ids, state_slot, num_tokens)
        # Leases run on the monotonic clock here; the handle carries wall-clock time for the peer.
        expiry = time.time() + (lease.expires_at - self.leases.clock())
        return TransferHandle(engine_id=self.agent.engine_id, agent_name=self.agent.agent_name,
                              request_id=request_id, num_tokens=num_tokens, kv_block_ids=tuple(block_ids),
                              state_slot=state_slot, lease_expiry=expiry, lease_id=lease.lease_id)

    def renew(self, request_id: str, lease_id: str, seconds: float | None) -> float:
        """Side-channel callback: extend a lease; returns seconds until the new expiry."""
        return self.leases.renew(request_id, lease_id, seconds) - self.leases.clock()

    def release(self, request_id: str) -> bool:
        """Abort: free the request's resources now (a later READ of them is refused by the lease)."""
        lease = self.leases.release(request_id)
        if lease is not None:
            self._free(lease)
        return lease is not None

    def poll(self) -> list[Lease]:
        freed = []
        for request_id in self.agent.notifications():
            lease = self.leases.complete(request_id)
            if lease is not None:
                self.agent.stats.leases_completed += 1
                freed.append(lease)
        expired = self.leases.expire()
        self.agent.stats.lease_expiries += len(expired)
        freed.extend(expired)
        for lease in freed:
            self._free(lease)
        return freed
