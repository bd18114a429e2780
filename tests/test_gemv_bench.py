"""benchmarks/gemv_bench.py in its smoke mode: the fused GEMV against separate op + GEMM, tiny shapes on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (the Makefile's CPU install lacks it)")

# Its flags' refusals (a SystemExit with a message: the process prints it and exits 1) are checked in this process.
from benchmarks import gemv_bench  # noqa: E402

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
    with pytest.raises(SystemExit, match="--batches: expected comma-separated integers"):
        gemv_bench.main(["--smoke", "--batches", "1,x"])


@pytest.mark.parametrize(("stages", "message"), [("1,x", "expected comma-separated integers"),
                                                 ("0,2", "expected integers >= 1")])
def test_bad_sweep_stages_are_refused(stages, message):
    with pytest.raises(SystemExit, match=f"--sweep-stages: {message}"):
        gemv_bench.main(["--smoke", "--sweep-stages", stages])


@pytest.mark.parametrize(("opt", "value"), [("--sweep-warps", "3"), ("--sweep-split-k", "1,x"),
                                            ("--sweep-block-m", "0"), ("--sweep-block-k", "")])
def test_bad_sweep_tiles_are_refused(opt, value):
    with pytest.raises(SystemExit, match=f"{opt}: expected comma-separated powers of two"):
        gemv_bench.main(["--smoke", opt, value])


SWEEP_PROBE = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from baton.engine.ops.linear import kernel as triton_gemv
from benchmarks import gemv_bench
tried, run = [], triton_gemv.fused_linear_triton
def record(*a, tiles=None, **k):
    tried.append(None if tiles is None else [tiles.block_m, tiles.block_k, tiles.split_k])
    return run(*a, tiles=tiles, **k)
triton_gemv.fused_linear_triton = record
row = gemv_bench.bench_layer(gemv_bench.Layer("x", "none", 40, 64, 1), 20, torch.device("cpu"), torch.float32, True,
                             0, (2,), {"block_n": (16,), "block_k": (32, 64), "block_m": (16, 32), "split_k": (1, 2)})
print(json.dumps({"tried": tried, "best": row.best_tiles, "best_us": row.best_us, "fused_us": row.fused_us}))
"""


def test_sweep_tries_rows_k_tiles_and_splits_and_keeps_the_fastest():
    """The tensor-core sweep's options multiply: blocks of rows x K tiles x splits (a split needs a K tile per
    program: K = 64 in 64-long tiles is not split); the best tile is one it timed."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", SWEEP_PROBE, str(SCRIPT.parent.parent)], capture_output=True, text=True,
                       timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    swept = {tuple(t) for t in got["tried"] if t is not None and t != [16, 64, 1]}  # (the default: 16 rows, K 64)
    assert swept == {(16, 32, 1), (16, 32, 2), (32, 32, 1), (32, 32, 2), (32, 64, 1)}
    m, n, k, warps, stages, split = got["best"]
    assert (m, k, split) in swept | {(16, 64, 1)} and got["best_us"] <= got["fused_us"]
