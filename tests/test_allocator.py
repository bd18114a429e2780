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


def test_lowest_ids_first_keeps_runs_consecutive():
    fl = FreeList(16, "blocks")
    a = fl.allocate(4)
    b = fl.allocate(4)
    fl.free(a[::-1])
    # Freed in any order, reused lowest first: the next request gets one consecutive run again.
    assert fl.allocate(4) == [0, 1, 2, 3] and b == [4, 5, 6, 7]
