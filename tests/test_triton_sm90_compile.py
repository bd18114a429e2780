"""Every Triton kernel the engine launches on a GPU compiles for sm_90 (H100 / H200), checked on a machine without
one: tests/sm90_compile.py calls each op's wrapper on CPU tensors with Triton's driver answering for an sm_90
device and compiles each launch instead of running it (the interpreter tests run the kernels, but never compile
them). A fresh Triton cache, so every kernel is compiled here."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "sm90_compile.py"

pytest.importorskip("triton")


def _env(cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return env | {"TRITON_CACHE_DIR": str(cache), "TRITON_DEFAULT_FP_FUSION": "1", "PYTHONPATH": str(ROOT)}


def _run(tmp_path: Path, *cases: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *cases], cwd=ROOT, env=_env(tmp_path / "triton-cache"),
                          capture_output=True, text=True, timeout=900)


def test_every_kernel_compiles_for_sm90(tmp_path):
    # Two shards side by side (the compiler is single-threaded; this box has two cores).
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), "--shard", f"{i}/2"], cwd=ROOT,
                              env=_env(tmp_path / f"triton-cache-{i}"), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in (1, 2)]
    outs = [p.communicate(timeout=900) for p in procs]
    stdout = "".join(o for o, _ in outs)
    assert all(p.returncode == 0 for p in procs), stdout[-6000:] + "".join(e for _, e in outs)[-3000:]
    assert "15 of 15 cases compiled for sm_90" in outs[0][0] and "15 of 15 cases compiled for sm_90" in outs[1][0]
    # The GPU-only variants were built: 16-bit dots, PDL launches, split-K decode attention and its merge.
    for kernel in ("_paged_attention_kernel", "_combine_splits_kernel", "_conv_varlen_rows_kernel", "_ssd_output_kernel",
                   "_ssu_verify_kernel", "_gemv_row_kernel", "_chain_inputs_kernel",
                   "_tempered_verify_kernel", "_rope_kernel", "_process_kernel", "_min_p_kernel", "_slice_kernel",
                   "_pack_kernel", "_block_fp8_gemm", "_act_quant_kernel", "_gdn_decode_kernel", "_gdn_verify_kernel",
                   "_wy_solve_kernel", "_wy_wu_kernel", "_wy_scan_kernel", "_wy_state_kernel", "_wy_output_kernel",
                   "_moe_gemm_kernel", "_place_kernel", "_sum_rows_kernel"):
        assert kernel in stdout
    assert "'NATIVE_DOT': True" in stdout and "'PDL': True" in stdout
    assert "'DOUBLING': True" in stdout and "'DOUBLING': False" in stdout  # both inversions of the GDN solve
    # The fused MoE's grouped GEMM on FP8 stacks, both scale kinds, beside its 16-bit build.
    assert all(f"'WSCALE': {w}" in stdout for w in (0, 1, 2))


def test_a_kernel_that_only_the_interpreter_runs_fails_here(tmp_path):
    """The harness reports what the compiler rejects: a value int32 on one side of a runtime branch, int64 on the
    other (the interpreter runs that kernel)."""
    run = _run(tmp_path, "broken")
    assert run.returncode == 1
    assert "Mismatched type for pos" in run.stdout and "0 of 1 cases compiled for sm_90; failed: broken" in run.stdout


@pytest.fixture
def harness(monkeypatch):
    """The harness imported into this process, for its argument checks (they come before it swaps Triton's driver
    and launcher, which are put back afterwards all the same)."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    monkeypatch.setattr(driver, "_active", driver._active)
    monkeypatch.setattr(JITFunction, "run", JITFunction.run)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    spec = importlib.util.spec_from_file_location("sm90_compile", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_unknown_cases_are_refused(harness):
    # A SystemExit with a message: the process prints it to stderr and exits 1.
    with pytest.raises(SystemExit, match="expected cases among conv varlen"):
        harness.main(["conv varlen", "nope"])


@pytest.mark.parametrize("spec", ["3/2", "x"])
def test_bad_shards_are_refused(harness, spec):
    with pytest.raises(SystemExit, match="--shard expected I/N with 1 <= I <= N"):
        harness.main(["--shard", spec])
