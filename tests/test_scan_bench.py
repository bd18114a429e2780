"""benchmarks/scan_bench.py's timing (GPU only: the benchmark needs a CUDA device)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

REF = Path(__file__).resolve().parent.parent / ".ref" / "mamba_ssm-2.2.4"


def test_gpu_device_time_leaves_out_the_hosts_launch_work():
    """A call of many tiny launches: its queued device time per call is well under its single-call latency,
    which holds the host's launch work on an idle GPU; a long kernel's two measures agree."""
    from benchmarks.scan_bench import device_ms, time_ms

    x = torch.zeros(16, device="cuda")

    def host_heavy():
        for _ in range(200):
            x.add_(1)

    assert device_ms(host_heavy) < 0.5 * time_ms(host_heavy)
    a = torch.randn(4096, 4096, device="cuda")

    def long_kernel():
        return a @ a

    d, s = device_ms(long_kernel), time_ms(long_kernel)
    assert 0.7 * s < d < 1.3 * s


@pytest.mark.skipif(not REF.is_dir(), reason="the reference is not fetched (bash benchmarks/fetch_reference.sh)")
def test_gpu_scan_bench_runs(capsys):
    from benchmarks.scan_bench import main

    assert main(["--ref", str(REF), "--tokens", "1024", "--calls", "3", "--graph-launches", "5"]) == 0
    out = capsys.readouterr().out
    assert "| chunked scan | 1024 tokens" in out and "Single-call latency" in out
