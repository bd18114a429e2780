"""Test-only transfer faults: a decode node whose environment holds BATON_TEST_TRANSFER_FAULT_RATE=R fails about a
fraction R of its pulls with a `TransferError`, some before the READ is posted and some after it completed, so that
chaos tests (benchmarks/chaos.py, tests/test_chaos.py) run the real fallback: the decode node gives back what it
reserved and prefills the request itself. BATON_TEST_TRANSFER_FAULT_SEED (default 0) seeds the draws.

The variables are for tests only: no deployment sets them, and nothing but `TransferFaults.from_environ` reads them,
once, when the decode node starts. Unset (the default), no pull ever fails because of this module.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Mapping

from baton.transfer.errors import TransferError

FAULT_RATE_ENV = "BATON_TEST_TRANSFER_FAULT_RATE"
FAULT_SEED_ENV = "BATON_TEST_TRANSFER_FAULT_SEED"
# How every injected failure's message starts (the decode node logs it: chaos runs count them there).
INJECTED_MESSAGE = "injected transfer fault"


class InjectedTransferFault(TransferError):
    """A transfer failure made up by `TransferFaults` (test-only)."""


class TransferFaults:
    """Draws, at each of a pull's two fault points, whether that pull fails there."""

    def __init__(self, rate: float = 0.0, seed: int = 0) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"{FAULT_RATE_ENV}: expected a fraction in [0, 1], got {rate}")
        self.rate = rate
        # Two independent draws per pull that each fail with p fail the pull with 1 - (1 - p)**2 = rate.
        self._p = 1.0 - math.sqrt(1.0 - rate)
        self._rng = random.Random(seed)
        self.injected = 0

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> TransferFaults:
        """The faults the environment asks for (none when BATON_TEST_TRANSFER_FAULT_RATE is unset)."""
        env = os.environ if environ is None else environ
        rate_text, seed_text = env.get(FAULT_RATE_ENV, "0"), env.get(FAULT_SEED_ENV, "0")
        try:
            rate = float(rate_text)
        except ValueError:
            raise ValueError(f"{FAULT_RATE_ENV}: expected a fraction in [0, 1], got {rate_text!r}") from None
        try:
            seed = int(seed_text)
        except ValueError:
            raise ValueError(f"{FAULT_SEED_ENV}: expected an integer, got {seed_text!r}") from None
        return cls(rate, seed)

    def check(self, request_id: str, point: str) -> None:
        """Raises `InjectedTransferFault` for the drawn share of calls; `point` says where in the pull it is."""
        if self._p > 0.0 and self._rng.random() < self._p:
            self.injected += 1
            raise InjectedTransferFault(f"{INJECTED_MESSAGE} {point} ({FAULT_RATE_ENV})", request_id)
