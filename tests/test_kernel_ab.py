"""benchmarks/kernel_ab.py: an earlier commit's kernels imported beside the tree's, and the A/B table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks import kernel_ab as ka  # noqa: E402


def _has_history() -> bool:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode == 0


@pytest.mark.skipif(not _has_history(), reason="needs the git checkout")
def test_module_at_a_revision_is_its_own_module():
    old = ka.module_at("HEAD", ka.FILES["conv_varlen"], "kernel_ab_test_conv")
    from baton.engine.ops.conv import kernel_varlen as triton_conv_varlen
    assert old is not triton_conv_varlen and old.__name__ == "kernel_ab_test_conv"
    assert callable(old.causal_conv1d_varlen_triton)
    with pytest.raises(SystemExit, match="expected engine/ops/nope.py at revision 'HEAD'"):
        ka.module_at("HEAD", "engine/ops/nope.py", "kernel_ab_test_nope")


def test_speedup_reads_times_and_rates_the_right_way_round():
    times = ka.Row("conv_varlen", "c", "us", [300.0, 320.0, 310.0], [150.0, 160.0, 155.0], 0.0)
    rates = ka.Row("prefill_attention", "c", "TFLOP/s", [100.0, 110.0, 90.0], [200.0, 180.0, 220.0], 0.0)
    assert times.speedup == pytest.approx(2.0) and rates.speedup == pytest.approx(2.0)
    text = ka.table([times, rates], {"device_name": "x", "rev": "abc", "commit": "def", "command": "cmd"})
    assert "| conv_varlen | c | us | 300.0 / 320.0 / 310.0 | 150.0 / 160.0 / 155.0 | **2.00×** |" in text


def test_causal_flops_count_prefix_and_diagonal():
    # One query at context 0 sees 1 key; a row of 2 after a prefix of 3 sees 4 and 5 keys.
    per_key = 4 * ka.HEAD_DIM * ka.Q_HEADS
    assert ka.causal_flops([(0, 1)]) == per_key
    assert ka.causal_flops([(3, 2)]) == per_key * 9


def test_ops_and_device_are_checked():
    assert ka.parse_ops("decode_attention, conv_varlen") == ["decode_attention", "conv_varlen"]
    for bad in ("", "conv", "conv_varlen,scan"):
        with pytest.raises(SystemExit, match="--ops: expected a comma-separated subset"):
            ka.parse_ops(bad)
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="expected a CUDA device"):
            ka.main(["--rev", "HEAD"])
    with pytest.raises(SystemExit, match="--rounds: expected >= 1"):
        ka.main(["--rev", "HEAD", "--rounds", "0"])


@pytest.mark.gpu
def test_gpu_ab_runs_against_head(tmp_path):
    assert ka.main(["--rev", "HEAD", "--rounds", "1", "--ops", "conv_varlen", "--out", str(tmp_path)]) == 0
    assert (tmp_path / ka.JSON_NAME).exists()
