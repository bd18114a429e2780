"""Every Triton kernel the engine launches on a GPU compiles for sm_90 (H100 / H200), checked on a machine without
one: tests/sm90_compile.py calls each op's wrapper on CPU tensors with Triton's driver answering for an sm_90
device and compiles each launch instead of running it (the interpreter tests run the kernels, but never compile
them). A fresh Triton cache, so every kernel is compiled here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "sm90_compile.py"

pytest.importorskip("triton")


def _run(tmp_path: Path, *cases: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"TRITON_CACHE_DIR": str(tmp_path / "triton-cache"), "TRITON_DEFAULT_FP_FUSION": "1",
            "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(SCRIPT), *cases], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)


def test_every_kernel_compiles_for_sm90(tmp_path):
    run = _run(tmp_path)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert "17 of 17 cases compiled for sm_90" in run.stdout
    # The GPU-only variants were built: 16-bit dots, PDL launches, split-K decode attention and its merge.
    for kernel in ("_paged_attention_kernel", "_combine_splits_kernel", "_conv_varlen_rows_kernel", "_ssd_output_kernel",
                   "_ssu_verify_kernel", "_gemv_row_kernel", "_chain_inputs_kernel",
                   "_tempered_verify_kernel"):
        assert kernel in run.stdout
    assert "'NATIVE_DOT': True" in run.stdout and "'PDL': True" in run.stdout


def test_a_kernel_that_only_the_interpreter_runs_fails_here(tmp_path):
    """The harness reports what the compiler rejects: a value int32 on one side of a runtime branch, int64 on the
    other (the interpreter runs that kernel)."""
    run = _run(tmp_path, "broken")
    assert run.returncode == 1
    assert "Mismatched type for pos" in run.stdout and "0 of 1 cases compiled for sm_90; failed: broken" in run.stdout


def test_unknown_cases_are_refused(tmp_path):
    run = _run(tmp_path, "conv varlen", "nope")
    assert run.returncode != 0 and "expected cases among conv varlen" in run.stderr
