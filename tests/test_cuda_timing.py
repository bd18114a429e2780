"""`tests/cuda_timing.py`: the kernel benches' timing helper rejects counts it cannot use before touching CUDA."""

import pytest

from tests.cuda_timing import time_call_ms


def test_time_call_ms_rejects_bad_counts():
    calls = []
    with pytest.raises(ValueError, match="graph_launches expected >= 0, got -1"):
        time_call_ms(lambda: calls.append(1), warmup=1, iters=1, graph_launches=-1)
    with pytest.raises(ValueError, match="iters expected >= 1, got 0"):
        time_call_ms(lambda: calls.append(1), warmup=1, iters=0)
    assert calls == []  # nothing ran
