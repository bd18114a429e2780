"""Per-node transfer counters, ready to export as Prometheus metrics (issue #6)."""

from __future__ import annotations

import msgspec


class TransferStats(msgspec.Struct):
    transfers: int = 0          # READs completed (decode side)
    bytes: int = 0              # bytes moved by completed READs
    seconds: float = 0.0        # wall time of completed READs
    descriptors: int = 0        # descriptors issued
    failures: int = 0           # READs that ended in an error or a timeout
    lease_expiries: int = 0     # prefill side: leases that expired before the READ completed
    leases_completed: int = 0   # prefill side: leases freed by the decode side's notification
    skipped_blocks: int = 0     # decode side: KV blocks a READ left out, the node's prefix cache holding them

    @property
    def gbytes_per_second(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0
