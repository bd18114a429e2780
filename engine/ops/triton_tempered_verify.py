"""Triton kernel for `rejection_sampler.tempered_decisions` (the torch reference): speculative sampling of
deterministic drafts at a temperature, every row decided in one launch without the [R, 1+K, V] float32 copies
the reference makes (upcast, scaled logits, softmax, cumulative sums, the residual), which on a 128k vocabulary
cost more than the rest of the sampling put together.

One program per row; a greedy row (temperature 0) returns at once (its caller decides it by argmax). For
position j = 0, 1, ... while every draft before it was accepted: the row max m_j and the sum s_j of
e_i = exp((x_i - m_j) / t) in one pass over V (an online softmax: p_i = e_i / s_j), then the draft's accept test
u < p_j(d_j) with the reference's counter noise. At the first rejected position a the token is drawn from the
residual (p_a with d_a removed, unnormalised: one more pass for its mass), at the bonus position from p itself
(mass s_a), by inverse CDF: one pass that finds the first id whose cumulative mass exceeds u * mass (clamped to the
last id with mass). A row without drafts reads its logits twice. Sums run in another order than torch's, so a decision can differ from the reference only where the
noise falls within float32 rounding of its threshold.

Graph-capturable; no host reads.
"""

import triton
import triton.language as tl
from torch import Tensor

from baton.engine.counter_noise import _STREAM_KEYS, ACCEPT, DRAW

BLOCK = 4096


@triton.jit
def _mul32(x, c: tl.constexpr):
    # (x * c) mod 2^32 for x in [0, 2^32) in int64 without overflow, as counter_noise._mul32
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & 0xFFFFFFFF


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


@triton.jit
def _uniform(seed, position, key: tl.constexpr):
    # counter_noise.uniform for one (seed, position) and the stream whose key is given
    x = _mix32((position & 0xFFFFFFFF) ^ key)
    x = _mix32(x ^ (seed & 0xFFFFFFFF))
    x = _mix32(x ^ ((seed >> 32) & 0xFFFFFFFF))
    return (x >> 8).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def _row_stats(base, V, t, BLOCK: tl.constexpr):
    """(max x, sum exp((x - max) / t)) of one position's logits, in one pass (each lane's running sum rescaled
    when its maximum grows)."""
    offs = tl.arange(0, BLOCK)
    mx = tl.full([BLOCK], float("-inf"), tl.float32)
    acc = tl.zeros([BLOCK], tl.float32)
    for off in range(0, V, BLOCK):
        x = tl.load(base + off + offs, mask=off + offs < V, other=float("-inf")).to(tl.float32)
        new = tl.maximum(mx, x)
        ref = tl.where(new > float("-inf"), new, 0.0)  # (a lane that has seen only -inf: no -inf - -inf)
        acc = acc * tl.exp((mx - ref) / t) + tl.exp((x - ref) / t)
        mx = new
    m = tl.max(mx, axis=0)
    return m, tl.sum(acc * tl.exp((mx - m) / t), axis=0)


@triton.jit
def _tempered_verify_kernel(logits_ptr, drafts_ptr, nd_ptr, temp_ptr, seeds_ptr, pos_ptr, acc_ptr, final_ptr,
                            V, stride_r, stride_k, K: tl.constexpr, KEY_ACCEPT: tl.constexpr,
                            KEY_DRAW: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    t = tl.load(temp_ptr + r)
    if t > 0:
        nd = tl.load(nd_ptr + r)
        seed = tl.load(seeds_ptr + r)
        pos0 = tl.load(pos_ptr + r)
        row = logits_ptr + r * stride_r
        acc = nd * 0  # accepted drafts so far (int64)
        m_a = 0.0
        s_a = 1.0
        for j in tl.static_range(K + 1):
            if acc == j:  # every draft before position j was accepted: j decides
                m, s = _row_stats(row + j * stride_k, V, t, BLOCK)
                m_a = m
                s_a = s
                if j < nd:
                    d = tl.load(drafts_ptr + r * K + j)
                    x_d = tl.load(row + j * stride_k + d).to(tl.float32)
                    p_d = tl.exp((x_d - m) / t) / s
                    if _uniform(seed, pos0 + j, KEY_ACCEPT) < p_d:
                        acc = acc + 1
        # the draw at position acc: the residual after a rejected draft (its id excluded), else p
        base = row + acc * stride_k
        excl = acc * 0 - 1
        if acc < nd:
            excl = tl.load(drafts_ptr + r * K + acc)
        offs = tl.arange(0, BLOCK)
        total = s_a
        if excl >= 0:  # the residual's mass: p's without the rejected draft
            tot = tl.zeros([BLOCK], tl.float32)
            for off in range(0, V, BLOCK):
                i = off + offs
                x = tl.load(base + i, mask=i < V, other=float("-inf")).to(tl.float32)
                tot += tl.where(i == excl, 0.0, tl.exp((x - m_a) / t))
            total = tl.sum(tot, axis=0)
            if total <= 0.0:  # only the rejected draft had mass (rounding): draw from p
                excl = excl * 0 - 1
                total = s_a
        thr = _uniform(seed, pos0 + acc, KEY_DRAW) * total
        run = 0.0
        first = V
        last = 0
        for off in range(0, V, BLOCK):
            i = off + offs
            x = tl.load(base + i, mask=i < V, other=float("-inf")).to(tl.float32)
            e = tl.where(i == excl, 0.0, tl.exp((x - m_a) / t))
            c = tl.cumsum(e, axis=0) + run
            first = tl.minimum(first, tl.min(tl.where(c > thr, i, V), axis=0))
            last = tl.maximum(last, tl.max(tl.where(e > 0.0, i, 0), axis=0))
            run += tl.sum(e, axis=0)
        tl.store(acc_ptr + r, acc)
        tl.store(final_ptr + r, tl.minimum(first, last).to(tl.int64))


def tempered_decisions_triton(logits: Tensor, drafts: Tensor, num_draft: Tensor, temperature: Tensor, seeds: Tensor,
                              positions: Tensor) -> tuple[Tensor, Tensor]:
    """`rejection_sampler.tempered_decisions`, one launch: logits [R, K+1, V] (any float dtype, unit stride over
    V), drafts [R, K] int64 (padding in range), num_draft / seeds / positions [R] int64, temperature [R] float32 ->
    (accepted [R], final [R]) int64, defined on the rows whose temperature is above 0 (the others: zeros)."""
    R, K1, V = logits.shape
    if logits.stride(2) != 1:
        raise ValueError(f"tempered_decisions_triton: expected logits with unit stride over V, got strides "
                         f"{tuple(logits.stride())}")
    drafts = drafts.contiguous()
    accepted = logits.new_zeros(R, dtype=drafts.dtype)
    final = logits.new_zeros(R, dtype=drafts.dtype)
    if R:
        _tempered_verify_kernel[(R,)](
            logits, drafts, num_draft, temperature, seeds, positions, accepted, final, V, logits.stride(0),
            logits.stride(1), K=K1 - 1, KEY_ACCEPT=_STREAM_KEYS[ACCEPT], KEY_DRAW=_STREAM_KEYS[DRAW], BLOCK=BLOCK,
            num_warps=8,
        )
    return accepted, final
