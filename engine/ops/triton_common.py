"""Device helpers shared by the Triton kernels (`@triton.jit` functions, inlined where they are called), and
`interpreted()` for their host sides."""

import os

import triton
import triton.language as tl


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (its own test of the variable): there tl.dot takes no
    16-bit operands (numpy has none)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def round_to(v, dtype: tl.constexpr):
    """fp32 `v` cast to `dtype`, round to nearest even. Triton's interpreter truncates fp32 -> bf16 in
    `.to()`, so bf16 rounds here by hand (exact; the cast that follows only drops zero bits); on the GPU this
    is what the cast does anyway. fp16 and fp32 casts round correctly in both modes. NaN stays NaN."""
    if dtype == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        v = tl.where(v != v, v, bits.to(tl.float32, bitcast=True))
    return v.to(dtype)


@triton.jit
def softplus(v):
    # torch's softplus (beta 1, threshold 20): v above 20, else log1p(exp(v)), written as
    # max(v, 0) + log1p(exp(-|v|)). log1p(u) for u in (0, 1] uses Kahan's log(w) * u / (w - 1), w = 1 + u,
    # exact to a few ulps without libdevice (which the interpreter lacks).
    u = tl.exp(-tl.abs(v))
    w = 1.0 + u
    exact = w == 1.0
    log1p_u = tl.where(exact, u, tl.log(w) * (u / tl.where(exact, 1.0, w - 1.0)))
    return tl.where(v > 20.0, v, tl.maximum(v, 0.0) + log1p_u)
