"""Leases on the prefill side: a finished prefill's KV blocks and state slot are held for the decode
node to READ, and freed on its completion notification, on abort, or when the lease expires — never leaked.

Works on ints (block ids, slot ids) and a clock; the owner returns what `complete`/`release`/`expire`
hand back to its allocators.
"""

from __future__ import annotations

import math
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from baton.transfer.errors import LeaseExpired

DEFAULT_LEASE_SECONDS = 30.0
# The longest a lease may run (at hold or renewal): a peer cannot pin a request's caches for good.
MAX_LEASE_SECONDS = 600.0


@dataclass
class Lease:
    request_id: str
    block_ids: tuple[int, ...]
    state_slot: int
    num_tokens: int
    expires_at: float
    # Random, carried by the (signed) handle: a renewal must name it, so only the handle's holder can renew.
    lease_id: str = ""
    renewals: int = 0


class LeaseTable:
    def __init__(self, lease_seconds: float = DEFAULT_LEASE_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not (isinstance(lease_seconds, int | float) and 0 < lease_seconds <= MAX_LEASE_SECONDS):
            raise ValueError(f"lease_seconds: expected a number in (0, {MAX_LEASE_SECONDS:g}], got {lease_seconds!r}")
        self.lease_seconds = lease_seconds
        self.clock = clock
        self._leases: dict[str, Lease] = {}
        # Renewals arrive on the side-channel thread; everything else on the engine thread.
        self._lock = threading.Lock()
        self.num_completed = 0
        self.num_expired = 0
        self.num_released = 0

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._leases

    def hold(self, request_id: str, block_ids: tuple[int, ...] | list[int], state_slot: int,
             num_tokens: int) -> Lease:
        with self._lock:
            if request_id in self._leases:
                raise ValueError(f"request_id: expected no lease yet, got a second hold for {request_id!r}")
            lease = Lease(request_id, tuple(block_ids), state_slot, num_tokens, self.clock() + self.lease_seconds,
                          secrets.token_hex(16))
            self._leases[request_id] = lease
            return lease

    def renew(self, request_id: str, lease_id: str, seconds: float | None = None) -> float:
        """Extend a live lease named by its request and lease ids; returns the new expiry. A lease past its expiry
        cannot be renewed; `seconds` (default: the table's lease time) must be finite, in (0, MAX_LEASE_SECONDS]."""
        if seconds is not None and not (isinstance(seconds, int | float) and not isinstance(seconds, bool)
                                        and math.isfinite(seconds) and 0 < seconds <= MAX_LEASE_SECONDS):
            raise ValueError(f"seconds: expected None or a number in (0, {MAX_LEASE_SECONDS:g}], got {seconds!r}")
        with self._lock:
            lease = self._leases.get(request_id)
            # A wrong lease id reads as no lease: the caller learns nothing about other requests' leases.
            if (lease is None or lease.expires_at <= self.clock()
                    or not secrets.compare_digest(lease.lease_id, lease_id)):
                raise LeaseExpired(f"no live lease for {request_id!r}", request_id=request_id)
            lease.expires_at = self.clock() + (seconds or self.lease_seconds)
            lease.renewals += 1
            return lease.expires_at

    def complete(self, request_id: str) -> Lease | None:
        """The decode side's READ finished (its notification arrived): hand the resources back."""
        with self._lock:
            lease = self._leases.pop(request_id, None)
            self.num_completed += lease is not None
            return lease

    def release(self, request_id: str) -> Lease | None:
        """Abort: the request is gone; hand its resources back."""
        with self._lock:
            lease = self._leases.pop(request_id, None)
            self.num_released += lease is not None
            return lease

    def expire(self) -> list[Lease]:
        """Pop every lease past its expiry."""
        with self._lock:
            now = self.clock()
            gone = [lease for lease in self._leases.values() if lease.expires_at <= now]
            for lease in gone:
                del self._leases[lease.request_id]
            self.num_expired += len(gone)
            return gone

