"""Two more test-time speed-ups of Triton's interpreter (beside tests/interpreter_patch_once.py), neither a
change of what a kernel computes on tensors a test can build.

1. Integer overflow checks off. The interpreter runs every 32-bit integer add, sub and mul twice more, in 64
   bits, with a comparison against the type's range and an assertion
   (`semantic.binary_op_sanitize_overflow_impl`): a large share of an engine test's time
   (benchmarks/RESULTS.md, "Test suite"). Compiled kernels run these checks only in debug mode, which Baton
   never turns on, and an int32 offset overflows only past 2^31 elements, far beyond what a CPU test holds:
   with the checks off the interpreter wraps as the GPU does.
2. `_get_np_dtype` memoised. It builds a dict of every Triton dtype on each of its many calls a launch; the
   memo keeps its answer per scalar dtype name, the dict's own key.

`install()` leaves the interpreter alone and returns False if its internals have changed shape.
"""

from __future__ import annotations

import dataclasses


def install() -> bool:
    """Apply both speed-ups once; True once installed."""
    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter, "_baton_fast_paths", False):
        return True
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    get_np_dtype = getattr(interpreter, "_get_np_dtype", None)
    if (get_np_dtype is None or not dataclasses.is_dataclass(options)
            or "sanitize_overflow" not in {f.name for f in dataclasses.fields(options)}):
        return False
    builder.options = dataclasses.replace(options, sanitize_overflow=False)

    memo: dict[str, object] = {}

    def get_np_dtype_memoised(tt_dtype):
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(scalar, tl.pointer_type):
            return get_np_dtype(tt_dtype)
        got = memo.get(scalar.name)
        if got is None:
            got = memo[scalar.name] = get_np_dtype(scalar)
        return got

    get_np_dtype_memoised.__wrapped__ = get_np_dtype
    interpreter._get_np_dtype = get_np_dtype_memoised
    interpreter._baton_fast_paths = True
    return True
