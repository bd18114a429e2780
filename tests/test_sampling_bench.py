"""benchmarks/sampling_bench.py in its smoke mode: the sampling kernels against the torch reference, tiny shapes on
the CPU through Triton's interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (the Makefile's CPU install lacks it)")
pytestmark = pytest.mark.interpreter

from benchmarks import sampling_bench  # noqa: E402

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "sampling_bench.py"


def test_smoke_checks_and_times_every_k_and_batch(tmp_path):
    out = tmp_path / "sampling.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--no-progress", "--ks", "0,1", "--top-k", "20",
                        "--reps", "1", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    data = json.loads(out.read_text())
    assert {(row["k"], row["batch"]) for row in data["rows"]} == {(0, 1), (0, 3), (1, 1), (1, 3)}
    # (the interpreter's split columns: one program through the shared passes)
    assert all(row["differ"] == row["differ_one"] == 0 and row["splits"] == 1
               and min(row["argmax_us"], row["tempered_us"], row["tempered_one_us"], row["sort_us"],
                       row["filtered_us"], row["filtered_one_us"]) > 0 for row in data["rows"])
    assert data["meta"]["top_k"] == 20 and data["meta"]["vocab"] == 500
    assert "| K | batch | argmax | splits | tempered | tempered / 1 | sort (torch) | filtered (kernel) |" in r.stdout


@pytest.mark.parametrize(("extra", "message"), [
    (["--batches", "1,x"], "--batches: expected comma-separated integers"),
    (["--ks", "-1"], "--ks: expected integers >= 0"),
    (["--top-p", "1.0"], "at least one filtering"),
    (["--temperature", "0"], "--temperature: expected a value in (0, 100]"),
    (["--splits", "33"], "--splits: expected 0..32"),
    (["--splits", "2"], "sampling_bench: tempered_decisions_triton: expected splits 0 or 1 off a GPU, got 2"),
])
def test_bad_arguments_are_refused(extra, message):
    # A SystemExit with a message: the process prints it to stderr and exits 1.
    with pytest.raises(SystemExit) as refused:
        sampling_bench.main(["--smoke", *extra])
    assert message in str(refused.value.code)
