"""Aborts a worker did not answer: kept oldest first, for a bounded time and number, never extended by a re-send."""

import pytest

from baton.router.unsent_aborts import KEEP_S, UnsentAborts
from baton.router.worker_ids import ID_REUSE_AFTER_S


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_kept_until_sent_or_too_old_and_failed_resends_do_not_extend_it():
    clock = Clock()
    u = UnsentAborts(keep_s=10.0, clock=clock)
    u.add("a")
    clock.t += 4
    u.add("b")
    assert u.due() == ["a", "b"] and "a" in u and len(u) == 2
    clock.t += 4
    u.add("a")  # its re-send failed again: still kept from its first failure
    clock.t += 3
    assert u.due() == ["b"] and "a" not in u and u.num_dropped == 1
    u.discard("b")
    assert u.due() == [] and not u


def test_the_oldest_are_dropped_past_the_bound():
    u = UnsentAborts(max_kept=2, clock=Clock())
    for rid in ("a", "b", "c"):
        u.add(rid)
    assert u.due() == ["b", "c"] and u.num_dropped == 1


def test_kept_no_longer_than_a_worker_id_stays_reserved():
    assert 0 < KEEP_S < ID_REUSE_AFTER_S
    with pytest.raises(ValueError, match=r"keep_s: expected a number in \(0, 30\], got 31"):
        UnsentAborts(keep_s=31)
    with pytest.raises(ValueError, match="max_kept: expected an integer >= 1, got 0"):
        UnsentAborts(max_kept=0)
