"""benchmarks/gemv_bench.py in its smoke mode: the fused GEMV against separate op + GEMM, tiny shapes on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (the Makefile's CPU install lacks it)")

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gemv_bench.py"


def test_smoke_checks_every_prologue_and_sums_a_step(tmp_path):
    out = tmp_path / "gemv.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--no-progress", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(row["layer"], row["m"]) for row in rows} == {(n, m) for n in ("in_proj", "out_proj", "down_proj")
                                                          for m in (1, 2)}
    assert all(row["max_err"] < 1e-4 and row["fused_us"] > 0 and row["separate_us"] > 0 for row in rows)
    assert "| M | per step: separate µs |" in r.stdout


def test_bad_batches_are_refused():
    r = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--batches", "1,x"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and "--batches: expected comma-separated integers" in r.stderr


@pytest.mark.parametrize(("stages", "message"), [("1,x", "expected comma-separated integers"),
                                                 ("0,2", "expected integers >= 1")])
def test_bad_sweep_stages_are_refused(stages, message):
    r = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--sweep-stages", stages], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and f"--sweep-stages: {message}" in r.stderr
