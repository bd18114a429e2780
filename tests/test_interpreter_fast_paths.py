"""tests/interpreter_fast_paths.py, which tests/conftest.py installs wherever Triton's interpreter runs:
32-bit integer arithmetic wraps as compiled kernels' does outside debug mode, and the memoised dtype lookup
answers as the interpreter's own."""

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from tests.interpreter_fast_paths import install  # noqa: E402

pytestmark = pytest.mark.interpreter


@triton.jit
def _int_ops_kernel(a_ptr, b_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    a = tl.load(a_ptr + offs)
    b = tl.load(b_ptr + offs)
    tl.store(out_ptr + offs, a * b + a - b)


def test_int32_arithmetic_wraps_as_compiled_kernels_do():
    assert install()  # (conftest installed it: installing again changes nothing)
    assert interpreter.interpreter_builder.options.sanitize_overflow is False
    a = torch.tensor([2**30, -(2**31), 7, 46341], dtype=torch.int32)
    b = torch.tensor([4, 1, -3, 46341], dtype=torch.int32)
    out = torch.empty_like(a)
    _int_ops_kernel[(1,)](a, b, out, BLOCK=4)
    wide = a.long() * b.long() + a.long() - b.long()
    wrapped = ((wide + 2**31) % 2**32 - 2**31).to(torch.int32)
    assert torch.equal(out, wrapped)
    assert not torch.equal(wide, out.long())  # (the inputs do overflow)


@pytest.mark.parametrize("dtype", [tl.int1, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32,
                                   tl.int64, tl.uint64, tl.float16, tl.bfloat16, tl.float32, tl.float64,
                                   tl.float8e4nv, tl.float8e5], ids=str)
def test_memoised_dtype_lookup_answers_as_the_interpreter(dtype):
    memoised = interpreter._get_np_dtype
    original = memoised.__wrapped__
    pointer = tl.pointer_type(dtype)
    for tt in (dtype, tl.block_type(dtype, [4, 8]), pointer, tl.block_type(pointer, [2])):
        assert memoised(tt) == original(tt), tt
        assert memoised(tt) == original(tt), tt  # (the second answer comes from the memo)
