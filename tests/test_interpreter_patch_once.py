"""tests/interpreter_patch_once.py, which tests/conftest.py installs wherever Triton's interpreter runs: inside a
launch the interpreter patches `triton.language` once, not again for every helper call of every program, and the
kernels still compute what they did."""

import inspect

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from tests.interpreter_patch_once import install  # noqa: E402

pytestmark = pytest.mark.interpreter


@triton.jit
def _scaled(x, s):
    return x * s


@triton.jit
def _helpers_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    x = tl.load(x_ptr + pid * BLOCK + tl.arange(0, BLOCK))
    y = _scaled(_scaled(x, 2.0), 0.5)
    tl.store(out_ptr + pid, tl.sum(_scaled(y, 3.0), axis=0))  # tl.sum: Triton's own helper, which sees the core


def _launch(programs: int, block: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.arange(programs * block, dtype=torch.float32).reshape(programs, block) / 7
    out = torch.empty(programs)
    _helpers_kernel[(programs,)](x, out, BLOCK=block)
    return x, out


def test_a_launch_patches_the_language_a_fixed_number_of_times(monkeypatch):
    assert install()  # (conftest installed it: installing again changes nothing)
    members = inspect.getmembers
    calls = []
    monkeypatch.setattr(inspect, "getmembers", lambda *a, **kw: calls.append(1) or members(*a, **kw))
    counts = []
    # (The first launch that calls tl.sum rewrites it, and the interpreter then adds `tl` to its module: from the
    # second on, its one patch covers one more module.)
    for programs in (1, 1, 16):
        calls.clear()
        x, out = _launch(programs)
        torch.testing.assert_close(out, (x * 3).sum(dim=1))
        counts.append(len(calls))
    # Without the patch once a launch each of the 16 programs' four helper calls would patch four modules again.
    assert counts[1] == counts[2] > 0, counts
    # The launch's patch is undone when it ends.
    assert tl.core.is_builtin(tl.load) and tl.core.is_builtin(tl.tensor.__add__)
