"""Timing of one kernel call on CUDA for the `bench_*` helpers of the kernel tests (and `benchmarks/kernels_bench.py`).

Launched one by one from Python, a kernel that runs for a few microseconds is timed at its host launch cost (tens
of microseconds for a Triton wrapper). Replayed from a CUDA graph of back-to-back launches, as the engine's decode
and verify graphs run it, it is timed at what the GPU spends on it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def time_call_ms(call: Callable[[], object], *, warmup: int, iters: int, graph_launches: int = 0) -> float:
    """Milliseconds per `call()` on the current CUDA device.

    graph_launches = 0: `iters` eager calls between two CUDA events, after `warmup` calls (host launch cost
    included wherever it exceeds the kernel's time). graph_launches = n > 0: n back-to-back calls captured in one
    CUDA graph (after the warm-up, which compiles), that graph replayed `iters` times between two events.
    """
    if graph_launches < 0:
        raise ValueError(f"graph_launches expected >= 0, got {graph_launches}")
    if iters < 1:
        raise ValueError(f"iters expected >= 1, got {iters}")
    from baton.engine.cuda_graphs import capture_graph

    for _ in range(warmup):
        call()
    if graph_launches:
        def launches() -> None:
            for _ in range(graph_launches):
                call()

        graph, _ = capture_graph(launches, torch.device("cuda", torch.cuda.current_device()), None)
        graph.replay()  # the first replay uploads the graph
        run, per_run = graph.replay, graph_launches
    else:
        run, per_run = call, 1
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (iters * per_run)
