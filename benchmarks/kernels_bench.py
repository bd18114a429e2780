"""Mamba2 decode/verify kernels on the GPU: the Triton state update and conv update at the 8b-like layer size,
as achieved GB/s of the bytes each must move, against a device-to-device copy measured in the same run.

"decode" rows time the single-token kernels (each row's state read and written once). "verify T=5" rows
time the speculative-verify kernels by replay in their worst steady state: every row first replays T = 5
recorded positions of its last verify (replay = T), stores that state once, then runs its T new tokens in
registers. Their bytes are the state read once and written once, the T replayed inputs read and the T new
inputs recorded, plus x, dt, B, C and y (see `bench_ssu` / `bench_conv` in tests/).

Each kernel is timed inside a CUDA graph of `--graph-launches` back-to-back launches (default 100), as the engine's
decode and verify graphs run it; `--graph-launches 0` launches it one by one from Python instead, which times
the host's launch cost wherever that exceeds the kernel (batch 1, and the conv update at every batch).

  python benchmarks/kernels_bench.py            # one CUDA GPU
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

# The timing helpers live in the tests package at the repo root; `python benchmarks/kernels_bench.py` only
# puts benchmarks/ on the path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.test_ops_triton_conv import bench_conv  # noqa: E402
from tests.test_ops_triton_ssu import bench_ssu  # noqa: E402


def copy_gbps(nbytes: int = 1 << 30, iters: int = 20) -> float:
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        b.copy_(a)
    end.record()
    torch.cuda.synchronize()
    # A copy reads and writes every byte.
    return 2 * nbytes * iters / (start.elapsed_time(end) / 1e3) / 1e9


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--graph-launches", type=int, default=100,
                   help="launches per CUDA graph, replayed 10 times (0: eager launches, 100 timed)")
    a = p.parse_args(argv)
    if a.graph_launches < 0:
        p.error(f"--graph-launches expected >= 0, got {a.graph_launches}")
    if not torch.cuda.is_available():
        print("kernels_bench: needs a CUDA GPU", file=sys.stderr)
        return 2
    copy = copy_gbps()
    timing = dict(graph_launches=a.graph_launches, iters=10 if a.graph_launches else 100)
    rows = []
    for name, fn in [("state update (fp32 state)", lambda b, t: bench_ssu(b, T=t, **timing)),
                     ("conv update (bf16)", lambda b, t: bench_conv(b, T=t, **timing))]:
        for t in (1, 5):
            for batch in (1, 32, 256):
                ms, gbps = fn(batch, t)
                rows.append((name, "decode" if t == 1 else f"verify T={t}", batch, ms, gbps))
    how = f"CUDA graphs of {a.graph_launches} launches" if a.graph_launches else "eager launches"
    print(f"\nkernels_bench: {torch.cuda.get_device_name(0)}, torch {torch.__version__}; "
          f"device copy {copy:.0f} GB/s (read + write); {how}")
    print(f"{'kernel':<27} {'step':<11} {'batch':>5} {'us':>8} {'GB/s':>7} {'vs copy':>8}")
    for name, step, batch, ms, gbps in rows:
        print(f"{name:<27} {step:<11} {batch:>5} {1e3 * ms:>8.1f} {gbps:>7.0f} {gbps / copy:>8.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
