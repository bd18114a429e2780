"""benchmarks/scan_bench.py's timing (GPU only: the benchmark needs a CUDA device)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

REF = Path(__file__).resolve().parent.parent / ".ref" / "mamba_ssm-2.2.4"


def test_gpu_device_time_leaves_out_the_hosts_launch_work():
    """A call whose host work (1 ms) runs before its GPU work (~1.5-3 ms of matmuls): queued back to back the host
    stays ahead, so the device time per call is the GPU work alone; a single call on an idle GPU also waits for
    the host."""
    from benchmarks.scan_bench import device_ms, time_ms

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def gpu_work():
        a @ a
        a @ a

    def host_then_gpu():
        time.sleep(1e-3)
        gpu_work()

    gpu = device_ms(gpu_work, calls=10)
    queued, single = device_ms(host_then_gpu, calls=10), time_ms(host_then_gpu, iters=10)
    assert abs(queued - gpu) < 0.1 * gpu
    assert single > queued + 0.5  # the host's 1 ms, less scheduling slack


@pytest.mark.skipif(not REF.is_dir(), reason="the reference is not fetched (bash benchmarks/fetch_reference.sh)")
def test_gpu_scan_bench_runs(capsys):
    from benchmarks.scan_bench import main

    assert main(["--ref", str(REF), "--tokens", "1024", "--calls", "3", "--graph-launches", "5",
                 "--ref-tunings", "2"]) == 0
    out = capsys.readouterr().out
    assert "| chunked scan | 1024 tokens" in out and "Single-call latency" in out and "after each of 2 tunings" in out
