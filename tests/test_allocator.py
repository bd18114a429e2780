import pytest

from baton.engine.allocator import FreeList


def test_allocate_and_free_round_trip():
    fl = FreeList(8, "blocks")
    a = fl.allocate(3)
    b = fl.allocate(5)
    assert sorted(a + b) == list(range(8))
    assert fl.num_free == 0 and fl.num_used == 8
    assert not fl.can_allocate(1)
    fl.free(a)
    assert fl.num_free == 3 and fl.can_allocate(3) and not fl.can_allocate(4)
    fl.free(b)
    assert fl.num_free == 8 and fl.num_used == 0


def test_exhaustion_raises_and_allocates_nothing():
    fl = FreeList(4, "slots")
    fl.allocate(3)
    with pytest.raises(MemoryError, match="asked for 2, only 1 free"):
        fl.allocate(2)
    assert fl.num_free == 1


def test_double_free_and_foreign_id_are_bugs():
    fl = FreeList(4, "slots")
    ids = fl.allocate(2)
    fl.free(ids[:1])
    with pytest.raises(RuntimeError, match="double free"):
        fl.free(ids[:1])
    with pytest.raises(RuntimeError):
        fl.free([3])  # never allocated
    assert fl.num_free + fl.num_used == 4


@pytest.mark.parametrize("bad", [0, -1, 1.5, None])
def test_capacity_validated(bad):
    with pytest.raises(ValueError, match="capacity"):
        FreeList(bad, "x")


def test_free_is_all_or_nothing():
    fl = FreeList(8, "blocks")
    ids = fl.allocate(4)
    for bad in ([ids[0], 6], [ids[1], ids[1]]):  # a foreign id, an id twice
        with pytest.raises(RuntimeError, match="double free"):
            fl.free(bad)
        assert fl.num_used == 4 and fl.num_free == 4 and fl.free_runs() == [(4, 4)]
    fl.free(ids)
    assert fl.free_runs() == [(0, 8)]


def test_freed_runs_merge_with_their_neighbours_in_any_order():
    fl = FreeList(16, "blocks")
    a, b, c = fl.allocate(4), fl.allocate(4), fl.allocate(4)
    fl.free(a[::-1])
    fl.free(c[1::2])
    assert fl.free_runs() == [(0, 4), (9, 1), (11, 5)]  # 11 joins the free tail
    fl.free(c[0::2])
    assert fl.free_runs() == [(0, 4), (8, 8)]
    fl.free(b)
    assert fl.free_runs() == [(0, 16)] and fl.num_free_runs == 1


def test_best_fit_takes_the_smallest_run_that_holds_all():
    fl = FreeList(32, "blocks")
    ids = fl.allocate(32)
    fl.free(ids[2:5] + ids[8:10] + ids[12:18] + ids[20:30])  # runs (2, 3) (8, 2) (12, 6) (20, 10)
    assert fl.allocate(2) == [8, 9]  # the hole of exactly 2, not the lowest ids
    assert fl.allocate(5) == [12, 13, 14, 15, 16]  # 6 is the smallest run holding 5
    assert fl.allocate(3) == [2, 3, 4]
    assert fl.free_runs() == [(17, 1), (20, 10)]


def test_no_run_holds_it_the_longest_runs_first():
    fl = FreeList(20, "blocks")
    ids = fl.allocate(20)
    fl.free(ids[0:2] + ids[4:9] + ids[12:15])  # runs of 2, 5, 3
    assert fl.allocate(9) == [4, 5, 6, 7, 8, 12, 13, 14, 0]
    assert fl.free_runs() == [(1, 1)]


def test_growth_continues_after_the_last_id_while_it_is_free():
    fl = FreeList(16, "blocks")
    a = fl.allocate(2)
    b = fl.allocate(2, after=None)
    assert (a, b) == ([0, 1], [2, 3])
    # a's next id is b's: a grows in the best-fitting run; b grows right after itself.
    assert fl.allocate(1, after=a[-1]) == [4]
    assert fl.allocate(3, after=b[-1]) == [5, 6, 7]  # best fit, 4 taken
    fl.free([5, 6, 7])
    assert fl.allocate(2, after=4) == [5, 6]
    # Partly free after the last id: take that much there, the rest by best fit.
    fl.free(fl.allocate(2)[:1])  # 7 free, 8 taken
    assert fl.allocate(3, after=6) == [7, 9, 10]
    with pytest.raises(ValueError, match="expected n >= 0"):
        fl.allocate(-1, after=3)
    with pytest.raises(ValueError, match="after: expected an id blocks owns, got 11"):
        fl.allocate(1, after=11)
    assert fl.num_free == 5


def test_random_churn_keeps_the_invariants():
    import random

    rng = random.Random(7)
    fl = FreeList(257, "blocks")
    owned: list[list[int]] = []
    for _ in range(3000):
        if owned and (rng.random() < 0.45 or not fl.can_allocate(1)):
            fl.free(owned.pop(rng.randrange(len(owned))))
        else:
            n = rng.randint(0, min(fl.num_free, 40))
            last = owned[-1][-1] if owned and owned[-1] and rng.random() < 0.5 else None
            ids = fl.allocate(n, after=last)
            assert len(ids) == n == len(set(ids))
            owned.append(ids)
        taken = {i for ids in owned for i in ids}
        free = {s + k for s, length in fl.free_runs() for k in range(length)}
        assert not taken & free and len(taken) + len(free) == 257 == fl.num_used + fl.num_free
        runs = fl.free_runs()  # maximal: no two runs touch
        assert all(s1 + n1 < s2 for (s1, n1), (s2, _) in zip(runs, runs[1:], strict=False))


def test_a_fresh_pool_hands_out_consecutive_ids():
    fl = FreeList(16, "blocks")
    a = fl.allocate(4)
    b = fl.allocate(4)
    fl.free(a[::-1])
    # Freed in any order, the hole is one run again: the next request of that size gets it whole.
    assert fl.allocate(4) == [0, 1, 2, 3] and b == [4, 5, 6, 7]
