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


@pytest.mark.parametrize(("tokens", "message"), [("1,x", "expected comma-separated integers"),
                                                 ("0,2", "expected integers >= 1")])
def test_bad_tokens_are_refused(tokens, message):
    with pytest.raises(SystemExit, match=f"--tokens: {message}"):
        moe_bench.main(["--smoke", "--tokens", tokens])


def test_bad_iters_are_refused():
    with pytest.raises(SystemExit, match="--iters: expected an integer >= 1, got 0"):
        moe_bench.main(["--smoke", "--iters", "0"])
