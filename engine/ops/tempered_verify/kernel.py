"""Triton kernel for `reference.tempered_decisions` and `filtered_decisions` (the torch references):
speculative sampling of deterministic drafts at a temperature, with or without top-k / top-p, every row decided in
one launch without the [R, 1+K, V] float32 copies the references make (upcast, scaled logits, softmax, cumulative
sums, the residual; with a filter, a sort of every distribution), which on a 128k vocabulary cost more than the
rest of the sampling put together.

One program per row (or several: split rows, below); a greedy row (temperature 0) returns at once (its caller
decides it by argmax). For position j = 0, 1, ... while every draft before it was accepted: the row max m_j and
the sum s_j of e_i = exp((x_i - m_j) / t) in one pass over V (an online softmax: p_i = e_i / s_j), then the
draft's accept test u < p_j(d_j) with the reference's counter noise. At the first rejected position a the token
is drawn from the residual (p_a with d_a removed, unnormalised: one more pass for its mass), at the bonus position
from p itself (mass s_a), by inverse CDF: one pass that finds the first id whose cumulative mass exceeds u * mass
(clamped to the last id with mass). A row without drafts reads its logits twice.

Top-k / top-p (`filtered_decisions_triton`): the sampler's filter keeps a prefix of the ids ordered by value, ties
by lowest id (`sampling._filter`'s stable sort). That prefix is a cut on an order-preserving integer key of the
value (`_key`): every id above the cut's key, and the lowest ids at it up to a count. `_cut` finds it without
sorting: top-k's key by a search on how many ids lie above (three keys tested per pass over V: ~8 passes for
bf16 logits), then top-p's, at or above it and above a bound from the mass top-p drops, by a search on the mass
above; the count at the cut key follows from the ids and mass above it, since tied ids have equal mass. The accept
test and the draw then weigh the dropped ids 0.

Split rows (`auto_splits`): a row's passes stream V through one SM, so with fewer rows than SMs each row takes
S programs (up to 32), each a slice of V. After every pass each publishes its partial sums (`_share`), waits on a
counter until the row's S programs have, and combines all S in the same order, so all S take the same branches of
the row's searches and decisions; the draw starts each slice's cumulative sum at the mass of the slices before it.
The wait needs the row's programs running at once. `_launch` keeps R * S within the SMs the process may use (an
MPS client's share included; the interpreter, which runs one program at a time, takes one), and launches a split
grid as a cooperative one: the driver runs it only with all its programs resident, and refuses one that cannot be
(a share of the GPU this process cannot see, say) with an error instead of leaving it waiting. `_launch` then
decides the rows with one program each, and from then on takes at most half the refused grid's programs. Splitting
makes a small batch's top-p rows several times faster than one program a row; the cooperative launch costs nothing.

Sums run in another order than torch's, so a decision can differ from the reference only where the noise (or a
top-p mass) falls within float32 rounding of its threshold.

Graph-capturable; no host reads.
"""

import functools
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from baton.engine.counter_noise import _STREAM_KEYS, ACCEPT, DRAW
from baton.engine.ops.tempered_verify.tuning import BLOCK, MAX_SPLITS
from baton.engine.ops.triton_common import cdiv


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
def _share(ws_ptr, ctr_ptr, r, q, S, b, a0, a1, a2, a3, a4, a5, SP: tl.constexpr):
    """Split rows: every program of row r publishes six partials of the row's b-th pass and gets all S programs'
    as an [SP, 8] tile (rows from S on, and columns 6-7: 0) once they are all published: a barrier on the row's
    counter, which `_launch` zeroes. The S programs of a row run at once (`_launch` keeps R * S within the SMs
    the process may use), so the wait ends. Double-buffered by b: a program can be one pass ahead of another, no
    more."""
    cols = tl.arange(0, 8)
    vals = tl.where(cols == 0, a0.to(tl.float32), tl.where(cols == 1, a1.to(tl.float32), tl.where(
        cols == 2, a2.to(tl.float32), tl.where(cols == 3, a3.to(tl.float32), tl.where(
            cols == 4, a4.to(tl.float32), a5.to(tl.float32))))))
    buf = ws_ptr + (r * 2 + b % 2) * (SP * 8)
    tl.store(buf + q * 8 + cols, vals, mask=cols < 6)
    tl.debug_barrier()
    tl.atomic_add(ctr_ptr + r, 1, sem="release", scope="gpu")
    target = (b + 1) * S
    seen = tl.atomic_add(ctr_ptr + r, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(ctr_ptr + r, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()
    rows = tl.arange(0, SP)
    tile = tl.load(buf + rows[:, None] * 8 + cols[None, :], mask=(rows[:, None] < S) & (cols[None, :] < 6),
                   other=0.0, cache_modifier=".cg")
    return tile, b + 1


@triton.jit
def _col(tile, j: tl.constexpr):
    """Column j of a `_share` tile: one value per split."""
    return tl.sum(tl.where(tl.arange(0, 8)[None, :] == j, tile, 0.0), axis=1)


@triton.jit
def _sums(ws_ptr, ctr_ptr, r, q, S, b, a0, a1, a2, a3, a4, a5, SPLIT: tl.constexpr, SP: tl.constexpr):
    """Six partial sums over this program's slice -> the row's sums (as float32 with SPLIT: counts stay exact below
    2^24), and the pass count b."""
    if SPLIT:
        tile, b = _share(ws_ptr, ctr_ptr, r, q, S, b, a0, a1, a2, a3, a4, a5, SP)
        a0 = tl.sum(_col(tile, 0), axis=0)
        a1 = tl.sum(_col(tile, 1), axis=0)
        a2 = tl.sum(_col(tile, 2), axis=0)
        a3 = tl.sum(_col(tile, 3), axis=0)
        a4 = tl.sum(_col(tile, 4), axis=0)
        a5 = tl.sum(_col(tile, 5), axis=0)
    return a0, a1, a2, a3, a4, a5, b


@triton.jit
def _row_stats(base, v0, v1, scale, ws_ptr, ctr_ptr, r, q, S, b, SPLIT: tl.constexpr, SP: tl.constexpr,
               BLOCK: tl.constexpr):
    """(max x, sum exp((x - max) / t)) of one position's logits, in one pass (each lane's running sum rescaled
    when its maximum grows; with SPLIT, each slice's then the row's)."""
    offs = tl.arange(0, BLOCK)
    mx = tl.full([BLOCK], float("-inf"), tl.float32)
    acc = tl.zeros([BLOCK], tl.float32)
    for off in range(v0, v1, BLOCK):
        x = tl.load(base + off + offs, mask=off + offs < v1, other=float("-inf")).to(tl.float32)
        new = tl.maximum(mx, x)
        ref = tl.where(new > float("-inf"), new, 0.0)  # (a lane that has seen only -inf: no -inf - -inf)
        acc = acc * tl.exp2((mx - ref) * scale) + tl.exp2((x - ref) * scale)
        mx = new
    m = tl.max(mx, axis=0)
    s = tl.sum(acc * tl.exp2((mx - tl.where(m > float("-inf"), m, 0.0)) * scale), axis=0)
    if SPLIT:
        tile, b = _share(ws_ptr, ctr_ptr, r, q, S, b, m, s, s, s, s, s, SP)
        ms = tl.where(tl.arange(0, SP) < S, _col(tile, 0), float("-inf"))
        m = tl.max(ms, axis=0)
        s = tl.sum(tl.where(ms > float("-inf"), _col(tile, 1) * tl.exp2((ms - m) * scale), 0.0), axis=0)
    return m, s, b


@triton.jit
def _key(x, SHIFT: tl.constexpr):
    """An int32 that orders as the float32 x (-0 as +0), with the low SHIFT bits, always 0 for the input dtype
    (bf16: 16, fp16: 13), dropped: equal keys, equal values."""
    b = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return (b ^ ((b >> 31) & 0x7FFFFFFF)) >> SHIFT


@triton.jit
def _above(base, v0, v1, t1, t2, t3, m, scale, MASS: tl.constexpr, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    """For three keys t1 <= t2 <= t3: how many ids of [v0, v1) have a key above each, and (when MASS) their mass,
    the sum of exp((x - m) / t), in one pass."""
    offs = tl.arange(0, BLOCK)
    n1 = tl.zeros([BLOCK], tl.int32)
    n2 = tl.zeros([BLOCK], tl.int32)
    n3 = tl.zeros([BLOCK], tl.int32)
    e1 = tl.zeros([BLOCK], tl.float32)
    e2 = tl.zeros([BLOCK], tl.float32)
    e3 = tl.zeros([BLOCK], tl.float32)
    for off in range(v0, v1, BLOCK):
        i = off + offs
        x = tl.load(base + i, mask=i < v1, other=float("-inf")).to(tl.float32)
        key = tl.where(i < v1, _key(x, SHIFT), t1)  # (past the slice: above none)
        a1, a2, a3 = key > t1, key > t2, key > t3
        if MASS:
            e = tl.exp2((x - m) * scale)
            e1 += tl.where(a1, e, 0.0)
            e2 += tl.where(a2, e, 0.0)
            e3 += tl.where(a3, e, 0.0)
        else:
            n1 += a1.to(tl.int32)
            n2 += a2.to(tl.int32)
            n3 += a3.to(tl.int32)
    return (tl.sum(n1, axis=0), tl.sum(n2, axis=0), tl.sum(n3, axis=0), tl.sum(e1, axis=0), tl.sum(e2, axis=0),
            tl.sum(e3, axis=0))


@triton.jit
def _least_key(base, v0, v1, lo, hi, m, scale, k, P, ws_ptr, ctr_ptr, r, q, S, b, MASS: tl.constexpr,
               SHIFT: tl.constexpr, SPLIT: tl.constexpr, SP: tl.constexpr, BLOCK: tl.constexpr):
    """The least key tau in (lo, hi] (int64; hi qualifies) whose ids above it number fewer than k (MASS False) or
    hold less mass than P (MASS True): the key of the last id kept by the cut. A search in quarters: three keys
    tested per pass over V (~8 passes for bf16 logits)."""
    while hi - lo > 1:
        d = hi - lo
        t1 = lo + tl.maximum(d // 4, 1)
        t2 = lo + tl.maximum(d // 2, 1)
        t3 = lo + tl.maximum((3 * d) // 4, 1)
        n1, n2, n3, e1, e2, e3 = _above(base, v0, v1, t1.to(tl.int32), t2.to(tl.int32), t3.to(tl.int32), m, scale,
                                        MASS, SHIFT, BLOCK)
        n1, n2, n3, e1, e2, e3, b = _sums(ws_ptr, ctr_ptr, r, q, S, b, n1, n2, n3, e1, e2, e3, SPLIT, SP)
        if MASS:
            ok1, ok2, ok3 = e1 < P, e2 < P, e3 < P
        else:
            ok1, ok2, ok3 = n1 < k, n2 < k, n3 < k
        if ok1:
            hi = t1
        elif ok2:
            lo = t1
            hi = t2
        elif ok3:
            lo = t2
            hi = t3
        else:
            lo = t3
    return hi, b


@triton.jit
def _group(base, v0, v1, c, m, scale, ws_ptr, ctr_ptr, r, q, S, b, SHIFT: tl.constexpr, SPLIT: tl.constexpr,
           SP: tl.constexpr, BLOCK: tl.constexpr):
    """(ids above key c, their mass, ids at key c, the mass of one of them, ids at key c in the slices before
    this program's, the pass count b) in one pass."""
    offs = tl.arange(0, BLOCK)
    n_a = tl.zeros([BLOCK], tl.int32)
    e_a = tl.zeros([BLOCK], tl.float32)
    n_c = tl.zeros([BLOCK], tl.int32)
    x_c = tl.full([BLOCK], float("-inf"), tl.float32)
    for off in range(v0, v1, BLOCK):
        i = off + offs
        x = tl.load(base + i, mask=i < v1, other=float("-inf")).to(tl.float32)
        key = _key(x, SHIFT)
        above = (key > c) & (i < v1)
        at = (key == c) & (i < v1)
        n_a += above.to(tl.int32)
        e_a += tl.where(above, tl.exp2((x - m) * scale), 0.0)
        n_c += at.to(tl.int32)
        x_c = tl.maximum(x_c, tl.where(at, x, float("-inf")))
    na = tl.sum(n_a, axis=0)
    ea = tl.sum(e_a, axis=0)
    nc = tl.sum(n_c, axis=0)
    xc = tl.max(x_c, axis=0)
    before = nc * 0
    if SPLIT:
        tile, b = _share(ws_ptr, ctr_ptr, r, q, S, b, na, ea, nc, xc, xc, xc, SP)
        splits = tl.arange(0, SP)
        counts = _col(tile, 2)
        na = tl.sum(_col(tile, 0), axis=0).to(tl.int32)
        ea = tl.sum(_col(tile, 1), axis=0)
        nc = tl.sum(counts, axis=0).to(tl.int32)
        xc = tl.max(tl.where(splits < S, _col(tile, 3), float("-inf")), axis=0)
        before = tl.sum(tl.where(splits < q, counts, 0.0), axis=0).to(tl.int32)
    return na, ea, nc, tl.exp2((xc - m) * scale), before, b


@triton.jit
def _cut(base, v0, v1, V, m, s, scale, k, top_p, ws_ptr, ctr_ptr, r, q, S, b, SHIFT: tl.constexpr,
         KEY_LO: tl.constexpr, SPLIT: tl.constexpr, SP: tl.constexpr, BLOCK: tl.constexpr):
    """The top-k (k in 1..V-1, else none) then top-p (< 1, else none) filter of one position, as
    `sampling._filter`'s stable sort keeps ids (by value, ties by lowest id), without sorting: (c, keep, mass,
    ties before, b), where the kept ids are those with a key above c and the `keep` lowest ids with key c, mass is
    the kept ids' sum of exp((x - m) / t) and `ties before` counts the ids with key c before this program's slice."""
    hi = _key(m, SHIFT).to(tl.int64)  # the max's key: no id above it
    lo = hi * 0 + KEY_LO  # below every key
    total = s
    c = lo + 1
    if (k > 0) & (k < V):
        c, b = _least_key(base, v0, v1, lo, hi, m, scale, k, 0.0, ws_ptr, ctr_ptr, r, q, S, b, False, SHIFT, SPLIT,
                          SP, BLOCK)
        n_a, e_a, n_c, e_c, before, b = _group(base, v0, v1, c.to(tl.int32), m, scale, ws_ptr, ctr_ptr, r, q, S, b,
                                               SHIFT, SPLIT, SP, BLOCK)
        total = e_a + (k - n_a).to(tl.float32) * e_c  # the top-k mass: ties at c kept up to k ids
        lo = c - 1
    P = top_p * total
    if top_p < 1.0:  # the least key at or above top-k's whose ids above hold less than top_p of its mass
        # A lower bound first: the n ids top-k keeps (all V without it) below theta = (total - P) / 2n hold at
        # most half the mass top-p drops, so the ids above any key under theta's hold more than P: the cut is at
        # or above it (fewer keys to search: ~4 passes instead of ~8 for bf16 logits).
        n = V * 1.0
        if (k > 0) & (k < V):
            n = k.to(tl.float32)
        theta = (total - P) / (2.0 * n)
        if theta > 0.0:
            lo = tl.maximum(lo, _key(m + tl.log2(theta) / scale, SHIFT).to(tl.int64) - 1)
        c, b = _least_key(base, v0, v1, lo, hi, m, scale, 0, P, ws_ptr, ctr_ptr, r, q, S, b, True, SHIFT, SPLIT, SP,
                          BLOCK)
    n_a, e_a, n_c, e_c, before, b = _group(base, v0, v1, c.to(tl.int32), m, scale, ws_ptr, ctr_ptr, r, q, S, b,
                                           SHIFT, SPLIT, SP, BLOCK)
    keep = n_c.to(tl.float32)
    if (k > 0) & (k < V):
        keep = tl.minimum(keep, (k - n_a).to(tl.float32))
    if (top_p < 1.0) & (e_c > 0.0):  # ids at c kept while the mass before them is below P (at least one)
        keep = tl.minimum(keep, tl.maximum(tl.ceil((P - e_a) / e_c), 1.0))
    return c.to(tl.int32), keep.to(tl.int32), e_a + keep * e_c, before, b


@triton.jit
def _tie_rank(base, v0, v1, c, d, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    """How many ids of [v0, v1) below d have key c."""
    offs = tl.arange(0, BLOCK)
    n = tl.zeros([BLOCK], tl.int32)
    end = tl.minimum(v1, d)
    for off in range(v0, end, BLOCK):
        i = off + offs
        x = tl.load(base + i, mask=i < end, other=float("-inf")).to(tl.float32)
        n += ((_key(x, SHIFT) == c) & (i < end)).to(tl.int32)
    return tl.sum(n, axis=0)


@triton.jit
def _weights(x, i, m, scale, excl, c, keep, ties, FILTER: tl.constexpr, SHIFT: tl.constexpr):
    """The unnormalised mass exp((x - m) / t) of a block of ids i, 0 for the excluded id and, with FILTER, for
    ids the cut drops (ties: the ids with key c before the block) -> (weights, ids with key c in the block)."""
    e = tl.where(i == excl, 0.0, tl.exp2((x - m) * scale))
    n_c = 0
    if FILTER:
        key = _key(x, SHIFT)
        at = key == c
        rank = tl.cumsum(at.to(tl.int32), axis=0) - at.to(tl.int32) + ties
        e = tl.where((key > c) | (at & (rank < keep)), e, 0.0)
        n_c = tl.sum(at.to(tl.int32), axis=0)
    return e, n_c


@triton.jit
def _draw_mass(base, v0, v1, m, scale, excl, c, keep, ties, ws_ptr, ctr_ptr, r, q, S, b, FILTER: tl.constexpr,
               SHIFT: tl.constexpr, SPLIT: tl.constexpr, SP: tl.constexpr, BLOCK: tl.constexpr):
    """The draw's total mass (`_weights`) and, with SPLIT, the mass of the slices before this program's (where
    its cumulative sums start), and b."""
    offs = tl.arange(0, BLOCK)
    tot = tl.zeros([BLOCK], tl.float32)
    for off in range(v0, v1, BLOCK):
        i = off + offs
        x = tl.load(base + i, mask=i < v1, other=float("-inf")).to(tl.float32)
        e, n_c = _weights(x, i, m, scale, excl, c, keep, ties, FILTER, SHIFT)
        tot += e
        ties += n_c
    total = tl.sum(tot, axis=0)
    before = total * 0.0
    if SPLIT:
        tile, b = _share(ws_ptr, ctr_ptr, r, q, S, b, total, total, total, total, total, total, SP)
        masses = _col(tile, 0)
        total = tl.sum(masses, axis=0)
        before = tl.sum(tl.where(tl.arange(0, SP) < q, masses, 0.0), axis=0)
    return total, before, b


@triton.jit
def _tempered_verify_kernel(logits_ptr, drafts_ptr, nd_ptr, temp_ptr, top_k_ptr, top_p_ptr, seeds_ptr, pos_ptr,
                            acc_ptr, final_ptr, ws_ptr, ctr_ptr, V, CH, S, stride_r, stride_k, K: tl.constexpr,
                            FILTER: tl.constexpr, SHIFT: tl.constexpr, KEY_LO: tl.constexpr,
                            KEY_ACCEPT: tl.constexpr, KEY_DRAW: tl.constexpr, SPLIT: tl.constexpr, SP: tl.constexpr,
                            BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    q = tl.program_id(1)  # this program's slice of V: [q * CH, (q + 1) * CH) (without SPLIT: one, all of V)
    v0 = q * CH
    v1 = tl.minimum(V, v0 + CH)
    t = tl.load(temp_ptr + r)
    if t > 0:
        # e_i = exp((x_i - m) / t) as exp2((x_i - m) * scale); capped so that a denormal t gives no 0 * inf
        scale = tl.minimum(1.4426950408889634 / t, 1e30)
        nd = tl.load(nd_ptr + r)
        seed = tl.load(seeds_ptr + r)
        pos0 = tl.load(pos_ptr + r)
        k = 0
        top_p = 1.0
        if FILTER:
            k = tl.load(top_k_ptr + r)
            top_p = tl.load(top_p_ptr + r)
        row = logits_ptr + r * stride_r
        b = q * 0  # the row's passes shared so far (SPLIT)
        acc = nd * 0  # accepted drafts so far (int64)
        m_a = 0.0
        s_a = 1.0
        c_a = (nd * 0 + KEY_LO).to(tl.int32)  # the decided position's cut (`_cut`; without a filter: all kept)
        keep_a = c_a * 0
        ties_a = c_a * 0  # ids at the cut's key before this program's slice
        for j in tl.static_range(K + 1):
            if acc == j:  # every draft before position j was accepted: j decides
                base = row + j * stride_k
                m, s, b = _row_stats(base, v0, v1, scale, ws_ptr, ctr_ptr, r, q, S, b, SPLIT, SP, BLOCK)
                c = c_a * 0 + KEY_LO
                keep = c * 0
                ties = c * 0
                if FILTER:  # noqa: SIM102 (a constexpr branch around a runtime one)
                    if ((k > 0) & (k < V)) | (top_p < 1.0):
                        c, keep, s, ties, b = _cut(base, v0, v1, V, m, s, scale, k, top_p, ws_ptr, ctr_ptr, r, q, S,
                                                   b, SHIFT, KEY_LO, SPLIT, SP, BLOCK)
                m_a = m
                s_a = s
                c_a = c
                keep_a = keep
                ties_a = ties
                if j < nd:
                    d = tl.load(drafts_ptr + r * K + j)
                    x_d = tl.load(base + d).to(tl.float32)
                    p_d = tl.exp2((x_d - m) * scale) / s
                    if FILTER:
                        key_d = _key(x_d, SHIFT)
                        if key_d < c:
                            p_d = p_d * 0.0
                        elif key_d == c:  # the pass runs only for a draft at the cut
                            rank = _tie_rank(base, v0, v1, c, d, SHIFT, BLOCK)
                            rank, _1, _2, _3, _4, _5, b = _sums(ws_ptr, ctr_ptr, r, q, S, b, rank, rank, rank, rank,
                                                                rank, rank, SPLIT, SP)
                            if rank >= keep:
                                p_d = p_d * 0.0
                    if _uniform(seed, pos0 + j, KEY_ACCEPT) < p_d:
                        acc = acc + 1
        # the draw at position acc: the residual after a rejected draft (its id excluded), else p
        base = row + acc * stride_k
        excl = acc * 0 - 1
        if acc < nd:
            excl = tl.load(drafts_ptr + r * K + acc)
        offs = tl.arange(0, BLOCK)
        total = s_a
        run = 0.0
        if (excl >= 0) | SPLIT:  # the draw's mass (the residual's: p's without the rejected draft; by slice)
            total, run, b = _draw_mass(base, v0, v1, m_a, scale, excl, c_a, keep_a, ties_a, ws_ptr, ctr_ptr, r, q,
                                       S, b, FILTER, SHIFT, SPLIT, SP, BLOCK)
            if (excl >= 0) & (total <= 0.0):  # only the rejected draft had mass (rounding): draw from p
                excl = excl * 0 - 1
                total = s_a
                run = 0.0
                if SPLIT:
                    total, run, b = _draw_mass(base, v0, v1, m_a, scale, excl, c_a, keep_a, ties_a, ws_ptr, ctr_ptr,
                                               r, q, S, b, FILTER, SHIFT, SPLIT, SP, BLOCK)
        thr = _uniform(seed, pos0 + acc, KEY_DRAW) * total
        first = V
        last = 0
        ties = ties_a
        for off in range(v0, v1, BLOCK):
            i = off + offs
            x = tl.load(base + i, mask=i < v1, other=float("-inf")).to(tl.float32)
            e, n_c = _weights(x, i, m_a, scale, excl, c_a, keep_a, ties, FILTER, SHIFT)
            ties += n_c
            cum = tl.cumsum(e, axis=0) + run
            first = tl.minimum(first, tl.min(tl.where(cum > thr, i, V), axis=0))
            last = tl.maximum(last, tl.max(tl.where(e > 0.0, i, 0), axis=0))
            run += tl.sum(e, axis=0)
        if SPLIT:  # the first id past thr and the last with mass, over the slices
            tile, b = _share(ws_ptr, ctr_ptr, r, q, S, b, first, last, last, last, last, last, SP)
            splits = tl.arange(0, SP)
            first = tl.min(tl.where(splits < S, _col(tile, 0), V * 1.0), axis=0).to(tl.int32)
            last = tl.max(_col(tile, 1), axis=0).to(tl.int32)
        if q == 0:
            tl.store(acc_ptr + r, acc)
            tl.store(final_ptr + r, tl.minimum(first, last).to(tl.int64))


# The low bits of a float32 upcast that are always 0, by input dtype (`_key`).
_SHIFTS = {torch.bfloat16: 16, torch.float16: 13, torch.float32: 0}


def usable_sms(sms: int, mps_percentage: str | None) -> int:
    """The SMs a process can hold programs on: the device's, or under MPS the share its client is given
    (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE), which the split rows' wait must not exceed."""
    text = (mps_percentage or "").strip()
    if not text:
        return sms
    try:
        percent = float(text)
    except ValueError:
        percent = -1.0
    if not 0.0 < percent <= 100.0:
        raise ValueError(f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE: expected a number in (0, 100], got {text!r}")
    return max(1, int(sms * percent / 100.0))


@functools.cache
def _sm_count(index: int) -> int:
    return usable_sms(torch.cuda.get_device_properties(index).multi_processor_count,
                      os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"))


# Per device: the smallest split grid (programs) the driver refused to hold at once (`_launch`).
_REFUSED: dict[int, int] = {}


def _capacity(index: int) -> int:
    """Programs a split launch may take on device `index`: its usable SMs (one program each), and after the driver
    refused a grid there, half of it (a few refusals, each in an eager call, bring a launch within any share of the
    GPU: the warm-up runs before a CUDA graph capture are such calls)."""
    return min(_sm_count(index), _REFUSED.get(index, 1 << 62) // 2)


@functools.cache
def cooperative_launch() -> bool:
    """Whether this Triton can launch a grid as a cooperative one (`launch_cooperative_grid`), which split rows
    need: without it a grid whose programs cannot all be resident would wait for ever, so rows keep one program."""
    from triton.backends.nvidia.compiler import CUDAOptions

    return "launch_cooperative_grid" in CUDAOptions.__dataclass_fields__


def auto_splits(rows: int, V: int, device: torch.device) -> int:
    """Programs per row: on a GPU, as many as leave no SM idle (at most MAX_SPLITS, and one block of V each),
    when that is 2 or more; else 0, one program a row without the shared passes (also on the CPU)."""
    if device.type != "cuda" or rows == 0 or not cooperative_launch():
        return 0
    n = min(MAX_SPLITS, cdiv(V, BLOCK), _capacity(device.index or 0) // rows)
    return n if n >= 2 else 0


def _check_splits(splits: int, rows: int, V: int, device: torch.device) -> None:
    if not 0 <= splits <= MAX_SPLITS:
        raise ValueError(f"tempered_decisions_triton: expected splits in 0..{MAX_SPLITS}, got {splits}")
    if device.type == "cuda":
        if splits and not cooperative_launch():
            raise ValueError(f"tempered_decisions_triton: expected splits 0 with Triton {triton.__version__}, which "
                             f"cannot launch a cooperative grid, got {splits}")
        capacity = _capacity(device.index or 0)
        if rows * splits > capacity:  # its programs would wait on ones that never start
            raise ValueError(f"tempered_decisions_triton: expected rows * splits within the {capacity} programs "
                             f"the GPU holds at once, got {rows} * {splits}")
    elif splits > 1:  # the interpreter runs one program at a time: the first would wait for ever
        raise ValueError(f"tempered_decisions_triton: expected splits 0 or 1 off a GPU, got {splits}")


def _launch(logits: Tensor, drafts: Tensor, num_draft: Tensor, temperature: Tensor, top_k: Tensor | None,
            top_p: Tensor | None, seeds: Tensor, positions: Tensor, splits: int | None) -> tuple[Tensor, Tensor]:
    R, K1, V = logits.shape
    if logits.stride(2) != 1:
        raise ValueError(f"tempered_decisions_triton: expected logits with unit stride over V, got strides "
                         f"{tuple(logits.stride())}")
    if logits.dtype not in _SHIFTS:
        raise ValueError(f"tempered_decisions_triton: expected logits of dtype {', '.join(map(str, _SHIFTS))}, got "
                         f"{logits.dtype}")
    auto = splits is None
    if splits is None:
        splits = auto_splits(R, V, logits.device)
    _check_splits(splits, R, V, logits.device)
    drafts = drafts.contiguous()
    # One zeroed buffer (one fill on the stream): accepted and final, then for split rows each row's partials
    # (`_share`, float32) and its counter (int32).
    size = drafts.element_size()
    ws_n, ctr_n = (2 * MAX_SPLITS * 8 * 4 * R // size, -(-4 * R // size)) if splits else (0, 0)
    buf = logits.new_zeros(2 * R + ws_n + ctr_n, dtype=drafts.dtype)
    accepted, final = buf[:R], buf[R:2 * R]
    shift = _SHIFTS[logits.dtype]
    if R:
        chunk = cdiv(cdiv(V, max(splits, 1)), BLOCK) * BLOCK if splits else V
        S = cdiv(V, chunk)  # (no empty slice)
        ws = counters = accepted  # (one program a row: unused)
        if splits:
            ws = buf[2 * R:2 * R + ws_n].view(torch.float32)
            counters = buf[2 * R + ws_n:].view(torch.int32)[:R]
        # A split grid on a GPU is cooperative: the driver runs it with every program resident, or refuses it.
        coop = {"launch_cooperative_grid": True} if splits and logits.is_cuda else {}
        try:
            _tempered_verify_kernel[(R, S)](
                logits, drafts, num_draft, temperature, temperature if top_k is None else top_k,
                temperature if top_p is None else top_p, seeds, positions, accepted, final, ws, counters, V, chunk,
                S, logits.stride(0), logits.stride(1), K=K1 - 1, FILTER=top_k is not None, SHIFT=shift,
                KEY_LO=(-(2**31)) >> shift, KEY_ACCEPT=_STREAM_KEYS[ACCEPT], KEY_DRAW=_STREAM_KEYS[DRAW],
                SPLIT=bool(splits), SP=MAX_SPLITS, BLOCK=BLOCK, num_warps=8, **coop,
            )
        except RuntimeError as e:
            if not coop or "cooperative launch" not in str(e):
                raise
            index = logits.device.index or 0
            _REFUSED[index] = min(_REFUSED.get(index, R * S), R * S)
            if not auto:
                raise ValueError(f"tempered_decisions_triton: the GPU refused {R} * {S} programs at once (split rows "
                                 f"wait on each other, so they must all be resident); expected fewer splits") from e
            return _launch(logits, drafts, num_draft, temperature, top_k, top_p, seeds, positions, 0)
    return accepted, final


def tempered_decisions_triton(logits: Tensor, drafts: Tensor, num_draft: Tensor, temperature: Tensor, seeds: Tensor,
                              positions: Tensor, splits: int | None = None) -> tuple[Tensor, Tensor]:
    """`reference.tempered_decisions`, one launch: logits [R, K+1, V] (bf16, fp16 or float32, unit stride
    over V), drafts [R, K] int64 (padding in range), num_draft / seeds / positions [R] int64, temperature [R]
    float32 -> (accepted [R], final [R]) int64, defined on the rows whose temperature is above 0 (the others:
    zeros). splits: programs per row (`auto_splits` when None; 0: one without the shared passes)."""
    return _launch(logits, drafts, num_draft, temperature, None, None, seeds, positions, splits)


def filtered_decisions_triton(logits: Tensor, drafts: Tensor, num_draft: Tensor, temperature: Tensor, top_k: Tensor,
                              top_p: Tensor, seeds: Tensor, positions: Tensor, splits: int | None = None
                              ) -> tuple[Tensor, Tensor]:
    """`tempered_verify.filtered_decisions`, one launch: as `tempered_decisions_triton` with top_k [R] int64 (0:
    none) and top_p [R] float32 (1: none) applied at every position, each cut found by a search instead of a sort
    (`_cut`)."""
    return _launch(logits, drafts, num_draft, temperature, top_k, top_p, seeds, positions, splits)
