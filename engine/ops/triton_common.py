"""Device helpers shared by the Triton kernels (`@triton.jit` functions, inlined where they are called), and
`interpreted()`, `cdiv()` and `next_power_of_2()` for their host sides."""

import functools
import os

import torch
import triton
import triton.language as tl
from torch import Tensor


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (its own test of the variable): there tl.dot takes no
    16-bit operands (numpy has none)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Launch arithmetic on the host: `triton.cdiv` and `triton.next_power_of_2` are constexpr functions in Triton 3.5+
# whose argument wrapping costs host time on every launch of an eager step. These give the same integers
# (`test_triton_common.py`).
def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for b > 0, as `triton.cdiv`."""
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n for n >= 1 (0 for 0), as `triton.next_power_of_2`."""
    n = int(n)
    return 1 << (n - 1).bit_length() if n > 0 else 0


@functools.cache
def _sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def sm_count(device: torch.device) -> int:
    """The CUDA device's number of SMs (cached per device)."""
    return _sm_count_of(_index(device))


@functools.cache
def _shared_memory_of(index: int) -> int:
    # (torch >= 2.6 on CUDA; a build without the property, e.g. ROCm's, reads 0: nothing large is assumed to fit)
    return int(getattr(torch.cuda.get_device_properties(index), "shared_memory_per_block_optin", 0))


def shared_memory_per_block(device: torch.device) -> int:
    """The most shared memory one program (CUDA block) may take on the CUDA device, in bytes, with the opt-in Triton
    takes (H100 / H200: 227 KB); 0 where torch does not say (cached per device)."""
    return _shared_memory_of(_index(device))


# Whether fp32 -> bf16 and -> fp8 casts round by hand (`round_to`): only in Triton's interpreter, which `triton.jit` itself
# chose from the same variable when the kernels were defined.
_BF16_BY_HAND = tl.constexpr(interpreted())


@triton.jit
def round_to(v, dtype: tl.constexpr):
    """fp32 `v` cast to `dtype`, round to nearest even. Triton's interpreter truncates fp32 -> bf16 in
    `.to()`, so there bf16 rounds here by hand (exact; the cast that follows only drops zero bits). On the GPU the
    cast itself rounds to nearest even (one cvt.rn per two values; by hand it took ~7 integer instructions per
    value, a quarter of the scan's state-walk instructions). fp16 and fp32 casts round correctly in both modes.
    The interpreter's fp32 -> float8_e4m3fn cast does not carry a rounded-up mantissa into the exponent, so there
    fp8 rounds here by hand too (`v` already within +-448, the format's largest finite value). NaN stays NaN."""
    if dtype == tl.bfloat16 and _BF16_BY_HAND:
        bits = v.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        v = tl.where(v != v, v, bits.to(tl.float32, bitcast=True))
    if dtype == tl.float8e4nv and _BF16_BY_HAND:
        # Normal e4m3 values keep 3 of fp32's 23 mantissa bits; below 2**-6 the step is 2**-9, which adding and
        # subtracting 1.5 * 2**14 (an fp32 whose ulp is 2**-9) rounds to, to nearest even.
        bits = v.to(tl.uint32, bitcast=True)
        normal = (((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) << 20).to(tl.float32, bitcast=True)
        a = tl.abs(v)
        sub = (a + 24576.0) - 24576.0
        sub = tl.where((bits >> 31) != 0, -sub, sub)  # a negative sign (-0.0 too) stays, as the cast keeps it
        v = tl.where(v != v, v, tl.where(a < 0.015625, sub, normal))
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


# Programmatic dependent launch (Hopper and later): a kernel launched with `launch_pdl` may start while the kernel
# before it on the stream is still running; it must wait (`gdc_wait`) before it reads anything an earlier kernel
# writes or writes anything an earlier kernel reads. The kernels that take `PDL` load only constants (weights)
# before that wait, then let the next kernel launch (`gdc_launch_dependents`): the launch and the first weight
# loads of kernel n+1 overlap the tail of kernel n. Both instructions are no-ops in a kernel launched without the
# attribute. (Letting the next kernel launch only after the GEMV's last tile, or no prefetch, is slower.)
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: never launched with PDL (see `pdl`)
    gdc_wait = gdc_launch_dependents = None


@triton.jit
def pdl_wait_only(PDL: tl.constexpr):
    """Wait for the kernels before this one (PDL launches only); the kernel lets the next one launch itself
    (`pdl_launch_next`), e.g. at its end: a persistent kernel's programs stream until then, and the next kernel's
    programs, launched early, would sit on their SMs waiting."""
    if PDL:
        gdc_wait()


@triton.jit
def pdl_launch_next(PDL: tl.constexpr):
    """Let the next kernel launch (PDL launches only)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait for the kernels before this one (PDL launches only), then let the next one launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


_PDL_DEVICES: dict[int, bool] = {}


# Kernels over more rows than this (dim 0 of the tensor given to `pdl`: tokens or decode rows) launch without PDL:
# their kernels are long, and launching each one early (its programs then wait on the SMs) costs more than it hides.
PDL_MAX_ROWS = 64


def pdl(t: Tensor) -> dict[str, bool]:
    """Launch keywords for a kernel that calls `pdl_wait(PDL)`: programmatic dependent launch on a CUDA device of
    compute capability 9.0 or later (not in the interpreter), for at most `PDL_MAX_ROWS` rows (`t`'s dim 0), unless
    BATON_PDL=0. `PDL` and `launch_pdl` always travel together: a kernel launched with the attribute and without
    its wait would race."""
    on = False
    rows = t.shape[0] if t.dim() else 1
    if (t.is_cuda and rows <= PDL_MAX_ROWS and gdc_wait is not None and not interpreted()
            and os.environ.get("BATON_PDL", "1") != "0"):
        index = t.device.index if t.device.index is not None else torch.cuda.current_device()
        if index not in _PDL_DEVICES:
            _PDL_DEVICES[index] = torch.cuda.get_device_capability(index)[0] >= 9
        on = _PDL_DEVICES[index]
    return {"PDL": on, "launch_pdl": on}
