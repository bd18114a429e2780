"""benchmarks/fp8_gemm_bench.py in its smoke mode: FP8 GEMV and block-scaled GEMM against bf16, tiny shapes on
the CPU (the kernels checked against the reference, the table written)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (the Makefile's CPU install lacks it)")

from benchmarks import fp8_gemm_bench  # noqa: E402

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "fp8_gemm_bench.py"


def test_smoke_times_every_path_and_checks_the_gemm(tmp_path):
    out = tmp_path / "fp8.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--batches", "1,20", "--gemv-max-rows", "1",
                        "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(row["layer"], row["m"]) for row in rows} == {(n, m) for n in ("in_proj", "down_proj") for m in (1, 20)}
    assert all(row["max_err"] < 1e-4 and row["fp8_block_us"] > 0 and row["act_quant_us"] > 0 for row in rows)
    assert all((row["fp8_gemv_us"] > 0) == (row["m"] == 1) for row in rows)
    assert "| layer | M | bf16 µs | fp8 block µs |" in r.stdout


def test_bad_batches_are_refused():
    with pytest.raises(SystemExit, match="--batches: expected comma-separated integers >= 1"):
        fp8_gemm_bench.main(["--smoke", "--batches", "1,0"])
