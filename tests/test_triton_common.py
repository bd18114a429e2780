"""The host-side launch arithmetic of the Triton kernels (`triton_common.cdiv`, `next_power_of_2`) gives the same
integers as Triton's constexpr functions it replaces on the host (those cost host time on every launch)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

triton = pytest.importorskip("triton", reason="triton is not installed (the Makefile's CPU install must add it)")
pytestmark = pytest.mark.interpreter

from baton.engine.ops.triton_common import cdiv, next_power_of_2  # noqa: E402

VALUES = [*range(0, 1100), 4095, 4096, 4097, 18560, 65535, 65536, 65537, 131072, 2**31 - 1, 2**31, 2**40 + 3]


def test_next_power_of_2_is_tritons():
    for n in VALUES:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
    assert [next_power_of_2(n) for n in (0, 1, 2, 3, 5, 64, 65)] == [0, 1, 2, 4, 8, 64, 128]


def test_cdiv_is_tritons():
    for b in (1, 2, 3, 7, 16, 64, 127, 128, 1024, 4096):
        for a in (*VALUES[:300], *VALUES[-12:], -1, -5, -128):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
    assert [cdiv(a, 64) for a in (0, 1, 64, 65, 8192)] == [0, 1, 1, 2, 128]


def test_no_kernel_host_side_calls_tritons_constexpr_arithmetic():
    """Each call of `triton.cdiv` / `triton.next_power_of_2` from Python wraps and unwraps constexprs: the kernels'
    host sides use the helpers above instead (the grep a change would otherwise slip past)."""
    from pathlib import Path

    ops = Path(__file__).resolve().parents[1] / "engine" / "ops"
    offenders = [f"{p.name}:{i}" for p in sorted(ops.glob("*.py"))
                 for i, line in enumerate(p.read_text().splitlines(), 1)
                 if ("triton.cdiv(" in line or "triton.next_power_of_2(" in line) and not line.lstrip().startswith("#")]
    assert offenders == []
