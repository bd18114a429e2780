"""benchmarks/scan_bench.py's re-tuning of the reference (CPU: only autotuner caches are touched, nothing runs)."""

from __future__ import annotations

import sys
import types

import pytest
import triton
import triton.language as tl

from benchmarks.scan_bench import main, retune_reference


@triton.autotune(configs=[triton.Config({"BLOCK": 16}), triton.Config({"BLOCK": 32})], key=["n"])
@triton.jit
def _tuned(x_ptr, n, BLOCK: tl.constexpr):
    tl.store(x_ptr + tl.arange(0, BLOCK), tl.zeros([BLOCK], tl.float32), mask=tl.arange(0, BLOCK) < n)


@pytest.fixture
def fake_reference(monkeypatch):
    """A module where the reference's kernels live, holding one autotuned kernel twice (a re-export)."""
    mod = types.ModuleType("mamba_ssm.ops.triton.ssd_fake")
    mod.kernel, mod.alias = _tuned, _tuned
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return mod


def test_retune_clears_each_reference_autotuner_once(fake_reference):
    _tuned.cache[(64,)] = _tuned.configs[1]  # as if a call had tuned it
    assert retune_reference() == 1
    assert _tuned.cache == {}


def test_retune_finds_nothing_without_the_reference(monkeypatch):
    for name in [n for n in sys.modules if n.startswith("mamba_ssm.ops.triton")]:
        monkeypatch.delitem(sys.modules, name)
    assert retune_reference() == 0


def test_ref_tunings_below_one_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--ref-tunings", "0"])
    assert e.value.code == 2
    assert "--ref-tunings: expected >= 1, got 0" in capsys.readouterr().err
