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
