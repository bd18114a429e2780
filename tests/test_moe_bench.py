"""benchmarks/moe_bench.py in its smoke mode: the fused MoE against the per-expert loop and a dense GEMM pair,
tiny shapes on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (the Makefile's CPU install lacks it)")

from benchmarks import moe_bench  # noqa: E402

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "moe_bench.py"


def test_smoke_times_every_path_and_checks_the_fused_one(tmp_path):
    out = tmp_path / "moe.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--json", str(out)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["tokens"] for row in rows] == [1, 5]
    assert all(row["max_err"] < 1e-4 and min(row["loop_ms"], row["fused_ms"], row["dense_ms"]) > 0 for row in rows)
    assert "| T | loop ms | fused ms | dense ms | loop / fused | fused / dense | max err |" in r.stdout
    assert all(row["fp8_ms"] is None for row in rows) and "fp8" not in r.stdout.split("| T |")[1]


@pytest.mark.parametrize("fp8", ["per-tensor", "block"])
def test_fp8_times_the_fp8_weight_path_beside_the_16_bit_one(tmp_path, fp8):
    out = tmp_path / "moe.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--tokens", "3", "--fp8", fp8, "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["meta"]["fp8"] == fp8
    (row,) = report["rows"]
    assert row["fused_ms"] > 0 and row["fp8_ms"] > 0 and row["fp8_err"] < 1e-4
    assert f"| fp8 ({fp8}) ms | fused / fp8 | fp8 err |" in r.stdout


def test_an_unknown_fp8_format_is_refused(capsys):
    with pytest.raises(SystemExit):
        moe_bench.main(["--smoke", "--fp8", "e5m2"])
    assert "--fp8: invalid choice: 'e5m2'" in capsys.readouterr().err


@pytest.mark.parametrize(("tokens", "message"), [("1,x", "expected comma-separated integers"),
                                                 ("0,2", "expected integers >= 1")])
def test_bad_tokens_are_refused(tokens, message):
    with pytest.raises(SystemExit, match=f"--tokens: {message}"):
        moe_bench.main(["--smoke", "--tokens", tokens])


def test_bad_iters_are_refused():
    with pytest.raises(SystemExit, match="--iters: expected an integer >= 1, got 0"):
        moe_bench.main(["--smoke", "--iters", "0"])
