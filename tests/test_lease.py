"""Leases: held resources are freed on completion, on release, or at expiry; renewals extend them."""

import pytest

from baton.transfer.errors import LeaseExpired
from baton.transfer.lease import LeaseTable


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_complete_release_and_expiry():
    clock = Clock()
    t = LeaseTable(lease_seconds=30, clock=clock)
    t.hold("a", [1, 2], 0, 20)
    t.hold("b", [3], 1, 5)
    t.hold("c", [4], 2, 5)
    assert t.complete("a").block_ids == (1, 2) and t.complete("a") is None
    assert t.release("b").state_slot == 1
    clock.t += 29.9
    assert t.expire() == []
    clock.t += 0.2
    (gone,) = t.expire()
    assert gone.request_id == "c" and len(t) == 0
    assert (t.num_completed, t.num_released, t.num_expired) == (1, 1, 1)


def test_renew_extends_and_cannot_revive():
    clock = Clock()
    t = LeaseTable(lease_seconds=10, clock=clock)
    lid = t.hold("a", [1], 0, 3).lease_id
    clock.t += 9
    assert t.renew("a", lid) == clock.t + 10
    clock.t += 9
    assert t.expire() == [] and t.renew("a", lid, seconds=2) == clock.t + 2
    with pytest.raises(LeaseExpired):  # the lease id of another lease does not renew this one
        t.renew("a", t.hold("b", [2], 1, 3).lease_id)
    clock.t += 2
    with pytest.raises(LeaseExpired):
        t.renew("a", lid)
    with pytest.raises(LeaseExpired):
        t.renew("never-held", lid)
    assert [x.request_id for x in t.expire()] == ["a"]


def test_double_hold_and_bad_lease_length():
    t = LeaseTable()
    t.hold("a", [1], 0, 1)
    with pytest.raises(ValueError, match="second hold"):
        t.hold("a", [2], 1, 1)
    with pytest.raises(ValueError, match="lease_seconds"):
        LeaseTable(lease_seconds=0)
