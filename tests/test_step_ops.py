"""benchmarks/step_ops.py: the host work of one engine step on the GPU path, counted on the CPU.

Run as a subprocess (it sets TRITON_INTERPRET for its own process). The counts are exact, so
they also hold the line on the per-layer work: a change that adds ops to every layer shows here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (the Makefile's CPU install lacks it)")

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "step_ops.py"
# Budgets of kernel ops + Triton launches of one step of the 27-layer 1b-hybrid pattern (12 M, 3 *, 12 -), a little
# above today's counts, so that a change which adds launches to every step fails here rather than slowing the GPU.
BUDGET = {"prefill": 192, "decode": 150, "verify": 215}


def run(tmp_path, *args):
    out = tmp_path / "ops.json"
    r = subprocess.run([sys.executable, str(SCRIPT), *args, "--json", str(out)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "per layer" in r.stdout and "most frequent" in r.stdout
    return json.loads(out.read_text())


def test_one_prefill_step_by_layer_kind(tmp_path):
    counts = run(tmp_path, "--rows", "2", "--tokens", "256")
    kinds, total = counts["by_kind"], counts["total"]
    assert set(kinds) == {"mamba2", "attention", "mlp", "rest"}
    # Every Mamba2 mixer: 2 GEMMs, its conv (2), scan (4: dt, state walk, C·B^T, output) and gated norm (1) kernels.
    # Every attention layer: 2 GEMMs (q/k/v fused, o), the KV write and the attention kernel. Every MLP: 2 GEMMs and
    # relu2. Every block's residual add and the next norm are one launch (27), plus the first norm. The rows sample
    # nothing (a prefill node's step), so the tail does not run: the last Mamba2 mixer's gated norm and out_proj,
    # the MLP after it and their two adds + norms (`pre_norm_stack`'s keep).
    assert (kinds["mamba2"]["kernels"], kinds["mamba2"]["triton"]) == (12 * 2 - 1, 12 * 7 - 1)
    assert (kinds["attention"]["kernels"], kinds["attention"]["triton"]) == (3 * 2, 3 * 2)
    assert (kinds["mlp"]["kernels"], kinds["mlp"]["triton"]) == (11 * 2, 11)
    assert kinds["rest"]["triton"] == 28 - 2
    assert total["kernels"] + total["triton"] <= BUDGET["prefill"], total


def test_one_decode_step(tmp_path):
    counts = run(tmp_path, "--step", "decode", "--rows", "1", "--tokens", "8")
    kinds, total = counts["by_kind"], counts["total"]
    assert (kinds["mamba2"]["kernels"], kinds["mamba2"]["triton"]) == (12 * 2, 12 * 3)  # conv, state, norm
    assert total["kernels"] + total["triton"] <= BUDGET["decode"], total


def test_one_decode_step_with_fused_gemv(tmp_path):
    counts = run(tmp_path, "--step", "decode", "--rows", "1", "--tokens", "8", "--fused-gemv-max-tokens", "16")
    kinds, total = counts["by_kind"], counts["total"]
    # Mamba2: the in_proj GEMV (with the add + norm), conv, state update, gated norm, the out_proj GEMV.
    assert (kinds["mamba2"]["kernels"], kinds["mamba2"]["triton"]) == (0, 12 * 5)
    # Attention: the q/k/v GEMV (with the add + norm), KV write, attention, the o_proj GEMV.
    assert (kinds["attention"]["kernels"], kinds["attention"]["triton"]) == (0, 3 * 4)
    assert (kinds["mlp"]["kernels"], kinds["mlp"]["triton"]) == (0, 12 * 2)  # up (add + norm), down (relu2)
    assert kinds["rest"]["triton"] == 2  # the final add + norm and the lm_head GEMV; no block norm on its own
    assert total["kernels"] + total["triton"] <= 110, total  # 145 without


def test_one_verify_step(tmp_path):
    counts = run(tmp_path, "--step", "decode", "--rows", "2", "--tokens", "8", "--spec", "1")
    kinds, total = counts["by_kind"], counts["total"]
    assert kinds["mamba2"]["triton"] == 12 * 4  # conv verify, state verify, its inputs' record, norm
    assert total["kernels"] + total["triton"] <= BUDGET["verify"], total


def test_bad_flags_are_refused():
    r = subprocess.run([sys.executable, str(SCRIPT), "--rows", "4", "--tokens", "2"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and "rows <= tokens" in r.stderr
    r = subprocess.run([sys.executable, str(SCRIPT), "--spec", "2"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--spec: expected" in r.stderr
