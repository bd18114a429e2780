"""benchmarks/prefill_ops.py: the host work of one eager prefill step on the GPU path, counted on the CPU.

Run as a subprocess (it sets BATON_KERNELS / TRITON_INTERPRET for its own process). The counts are exact,
so they also hold the line on the per-layer host work: a change that adds ops to every layer shows here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (the Makefile's CPU install lacks it)")

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "prefill_ops.py"
# Kernel ops + Triton launches of one prefill step of the 27-layer 1b-hybrid pattern, 2 rows: 182 when
# written, 323 before the residual adds were fused into the norms, the Mamba2 constants hoisted, relu2 and
# the KV write made one launch each and the attention program map built once per step.
STEP_BUDGET = 190


def test_counts_one_prefill_step_by_layer_kind(tmp_path):
    out = tmp_path / "ops.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--rows", "2", "--tokens", "256", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    counts = json.loads(out.read_text())
    kinds, step = counts["by_kind"], counts["step"]
    assert set(kinds) == {"mamba2", "attention", "mlp", "rest"}
    # Every Mamba2 mixer: 2 GEMMs, its conv (2), scan (3) and gated norm (1) kernels. Every attention layer:
    # 4 GEMMs, the KV write and the attention kernel. Every MLP: 2 GEMMs and relu2. Every block's residual
    # add and the next norm are one launch (27), plus the first norm.
    assert (kinds["mamba2"]["kernels"], kinds["mamba2"]["triton"]) == (12 * 2, 12 * 6)
    assert (kinds["attention"]["kernels"], kinds["attention"]["triton"]) == (3 * 4, 3 * 2)
    assert (kinds["mlp"]["kernels"], kinds["mlp"]["triton"]) == (12 * 2, 12)
    assert kinds["rest"]["triton"] == 28
    assert step["kernels"] + step["triton"] <= STEP_BUDGET, step
    assert "per layer" in r.stdout and "most frequent" in r.stdout


def test_bad_flags_are_refused():
    r = subprocess.run([sys.executable, str(SCRIPT), "--rows", "4", "--tokens", "2"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and "rows <= tokens" in r.stderr
