"""benchmarks/alloc_bench.py in its smoke mode: two real schedulers under churn; the engine's allocator keeps a
transferred request in one or two descriptors where lowest-first scatters it, and neither leaks a block."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "alloc_bench.py"
_spec = importlib.util.spec_from_file_location("alloc_bench", _PATH)
ab = importlib.util.module_from_spec(_spec)
sys.modules["alloc_bench"] = ab  # dataclasses look their module up
_spec.loader.exec_module(ab)


def test_smoke_freelist_keeps_transfers_in_few_descriptors(capsys, tmp_path):
    ours, lowest = ab.main(["--smoke", "--no-progress", "--json", str(tmp_path / "a.json")])
    assert (ours.allocator, lowest.allocator) == ("FreeList", "LowestFirst")
    assert ours.transfers == lowest.transfers > 200 and ours.blocks_mean == lowest.blocks_mean > 10
    assert ours.descriptors[0] <= 1.5 and ours.descriptors[3] <= 4  # mean, p99
    assert lowest.descriptors[0] >= 3 * ours.descriptors[0]
    assert ours.leaked == lowest.leaked == 0
    assert "| FreeList |" in capsys.readouterr().out and (tmp_path / "a.json").exists()


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="--rate: expected arrivals per decode step > 0, got 0.0"):
        ab.main(["--smoke", "--rate", "0", "--no-progress"])
    with pytest.raises(ValueError, match="--allocators: expected names from"):
        ab.main(["--smoke", "--allocators", "Buddy", "--no-progress"])


def test_compact_renumbers_into_twice_the_ids_and_keeps_every_run():
    import random

    import numpy as np

    from baton.transfer.plan import runs

    rng = random.Random(3)
    for _ in range(50):
        pool = list(range(5000))
        rng.shuffle(pool)
        n = rng.randint(1, 300)
        # Runs of random lengths at random places on both sides, in any order.
        remote = [i for s in sorted(pool[:n // 4 + 1]) for i in range(s * 8, s * 8 + rng.randint(1, 8))][:n]
        local = rng.sample(range(10**6), len(remote)) if rng.random() < 0.3 else list(range(7, 7 + len(remote)))
        cr, cl = ab.compact(remote), ab.compact(local)
        assert max(cr) < 2 * len(remote) and max(cl) < 2 * len(local)
        assert sorted(range(len(cr)), key=cr.__getitem__) == sorted(range(len(remote)), key=remote.__getitem__)
        assert len(runs(np.asarray(cl), np.asarray(cr))[0]) == len(runs(np.asarray(local), np.asarray(remote))[0])


def test_a_served_request_lands_in_fewer_runs_with_the_engines_allocator():
    import numpy as np

    from baton.transfer.plan import runs

    for seed in (0, 1):
        w = ab.Workload(requests=300, rate=0.3, prompt_mean=600, out_min=32, out_max=256, num_blocks=8192,
                        block_size=16, prefill_tokens=8192, prefill_every=20, transfer_steps=2, decode_seqs=128,
                        seed=seed)
        got = {a: ab.served_request(w, a, 4096) for a in ab.ALLOCATORS}
        n = {a: len(runs(np.asarray(local), np.asarray(remote))[0]) for a, (remote, local) in got.items()}
        assert all(len(r) == len(loc) == 256 for r, loc in got.values())
        assert n["FreeList"] <= 2 and n["LowestFirst"] >= 10 * n["FreeList"], n
