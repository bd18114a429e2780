"""Triton GEMV for few-token steps with the op before the linear layer fused in (`ops.linear.reference`).

Same signature, prologues and return values as the torch reference `fused_linear`. One launch computes
y = f(a) @ W^T (+ bias) over a grid of (blocks of BLOCK_N output features, blocks of BLOCK_M rows); each program
streams its W rows once, in [BLOCK_N, BLOCK_K] tiles, and builds the f(a) tile it multiplies them with from a
(and the residual / gate) as it goes, in fp32 registers, in one pass:

- The norms' RMS scales the dot product instead of each input: for a row's group (all of K; group_size
  channels for gated_norm), y = rsqrt(mean(v^2) + eps) * sum_k round(norm_weight_k * v_k) W_nk, with v the
  input before the norm (a, residual + a, or a * silu(gate)); the sum of squares is taken in the same pass.
  The separate ops round twice (the normalized input, then its product with the weight; gated: also the
  normalized value); here round(norm_weight * v) is the one rounding, so y differs from theirs by about one
  16-bit rounding of each input, in either direction.
- add_norm stores s = residual + a (rounded to a's dtype, exactly torch's add) from the programs of the first
  block of N only; every program computes the same s for itself.
- relu2 is torch's relu(a).square() bit for bit; the inputs are a few KB per row, read from L2 by every
  program (M x inputs x K per program: for large M that outgrows the weight itself, so the engine uses this
  for few-token steps only); W, the bulk, is read once.
- Products: BLOCK_M >= 16 uses tl.dot as y^T = W f(a)^T (the block of N on the MMA's long side, the rows on its
  short one; 16-bit operands, fp32 accumulator); smaller BLOCK_M (one or a few rows) multiplies and sums in fp32
  registers: the same products. fp32 inputs, and everything under Triton's interpreter, take tl.dot in IEEE fp32
  (`NATIVE_DOT` off: no TF32 rounding of an fp32 model; numpy has no bf16).

The weight rows are addressed through their stride, a / residual / gate rows through theirs (a slice of a wider
tensor needs no copy); the last dimension must be unit-stride. No host reads of device tensors, so a step's
launches can be captured in a CUDA graph. Launch shape (`GemvTiles`) depends on M only through BLOCK_M.
On Hopper (`triton_common.pdl`) each program waits for the kernel before it, then lets the next kernel launch;
with fewer than 16 rows it loads its first W tile before the wait, so a chain of GEMVs streams W with no launch
gap between them.

2-64 rows on the GPU (`default_tiles`: `GemvTiles.prologue_apart`): the op before the layer runs as its own
kernel (`ops.norm.kernel`, `ops.act.kernel`), then the tensor-core GEMM with no prologue, its a tile loaded straight into
the MMA's operand, because computing f(a) inside the K loop made the tensor-core GEMM slower than the separate op
+ cuBLAS while the GEMM alone is faster than cuBLAS. The layers with K > 4096 and N = 4096 (out_proj, down_proj)
have few blocks of N for the SMs: they take wider K tiles, and past K = 8192 K is split over two programs per
block of N whose partials the last to finish sums (`GemvTiles.split_k`); at 33-64 rows every layer takes one block
of 64 rows, K split in two past 4096 (`GemvTiles.cublas` routes a layer to cuBLAS instead; no default tile does).

One row on the GPU (`default_tiles`: `GemvTiles.programs_per_sm` > 0) runs `_gemv_row_kernel` instead: a
persistent grid of two programs per SM, each walking its blocks of N in one software-pipelined loop. Up to
K = 8192 each program computes f(a), its norm weights and RMS scale once and holds them in registers, so the
loop streams nothing but W; past that the loop is flattened over (block of N, block of K). It waits for the
kernel before it at its start and lets the next one launch at its end. This beats both the separate ops + cuBLAS
and one program per block of N for a batch-1 step (`benchmarks/RESULTS.md`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from baton.engine.ops.act.kernel import relu2_triton
from baton.engine.ops.linear.reference import check_fused_linear
from baton.engine.ops.norm.kernel import add_rms_norm_triton, gated_rms_norm_triton, rms_norm_triton
from baton.engine.ops.triton_common import (
    cdiv,
    next_power_of_2,
    pdl,
    pdl_launch_next,
    pdl_wait,
    pdl_wait_only,
    round_to,
    sm_count,
)
from baton.engine.ops.triton_common import interpreted as _interpreted

_CODES = {"none": 0, "relu2": 1, "norm": 2, "add_norm": 3, "gated_norm": 4}


@triton.jit
def _dequant_tile(w, sc_ptr, cols, cmask, k0, s_sc_n, dtype: tl.constexpr, WSCALE: tl.constexpr,
                  SCALE_N: tl.constexpr, SCALE_K: tl.constexpr):
    """A [BLOCK_N, BLOCK_K] weight tile in `dtype`: a 16-bit one as loaded; per-tensor FP8 (WSCALE 1) converted
    exactly (its scale multiplies the sums); block-wise FP8 (WSCALE 2; the tile within one block of K, starting at
    k0) times its blocks' scales, rounded once, as the reference's dequantized weight."""
    if WSCALE == 2:
        sc = tl.load(sc_ptr + (cols // SCALE_N) * s_sc_n + k0 // SCALE_K, mask=cmask, other=0.0)
        w = round_to(w.to(tl.float32) * sc[:, None], dtype)
    elif WSCALE == 1:
        w = w.to(dtype)
    return w


@triton.jit
def _row_dot(w, x, sc_ptr, cols, nmask, k_start, K, s_sc_n, WSCALE: tl.constexpr, SCALE_N: tl.constexpr,
             SCALE_K: tl.constexpr, SGK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_N] sums of one weight tile (columns k_start...) times x, in fp32. Block-wise FP8 (WSCALE 2): the
    products summed per SGK channels (within one block of K), each sum times its block's scale, then added."""
    prod = w.to(tl.float32) * x[None, :]
    if WSCALE == 2:
        kg = k_start + tl.arange(0, BLOCK_K // SGK) * SGK
        sc = tl.load(sc_ptr + (cols // SCALE_N)[:, None] * s_sc_n + (kg // SCALE_K)[None, :],
                     mask=nmask[:, None] & (kg < K)[None, :], other=0.0)
        return tl.sum(tl.sum(tl.reshape(prod, (BLOCK_N, BLOCK_K // SGK, SGK)), axis=2) * sc, axis=1)
    return tl.sum(prod, axis=1)




@triton.jit
def _prologue_raw(a_ptr, r_ptr, g_ptr, s_ptr, rows64, offs, mask, s_a_m, s_r_m, s_g_m, K,
                  STORE_S, PRO: tl.constexpr):
    """fp32 values of one input tile before any norm: a (none, norm), round(relu(a)^2) (relu2), round(a + r)
    (add_norm; stored to s where STORE_S), a * silu(gate) (gated_norm)."""
    a = tl.load(a_ptr + rows64 * s_a_m + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    if PRO == 1:  # relu2, rounded as torch's square of a 16-bit tensor
        r = tl.maximum(a, 0.0)
        a = round_to(r * r, a_ptr.dtype.element_ty).to(tl.float32)
    elif PRO == 3:
        r = tl.load(r_ptr + rows64 * s_r_m + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        a = round_to(a + r, a_ptr.dtype.element_ty)
        if STORE_S:
            tl.store(s_ptr + rows64 * K + offs[None, :], a, mask=mask)
        a = a.to(tl.float32)
    elif PRO == 4:
        z = tl.load(g_ptr + rows64 * s_g_m + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        a = a * tl.math.div_rn(z, 1.0 + tl.exp(-z))  # silu as torch computes it
    return a


@triton.jit
def _gemv_kernel(
    a_ptr, r_ptr, g_ptr, nw_ptr, s_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, sc_ptr,
    M, N, K, GROUP, M_PAD,
    s_a_m, s_r_m, s_g_m, s_w_n, s_y_m, s_sc_n,
    width, eps,
    PRO: tl.constexpr, HAS_BIAS: tl.constexpr, NATIVE_DOT: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr,
    WSCALE: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
):  # fmt: skip
    """One program per (block of N, block of rows). BLOCK_M >= 16 (DOT) computes y^T = W f(a)^T on the tensor
    cores: the block of N is the MMA's long side and the few rows its short one (padded to 16), the accumulator
    [BLOCK_N, BLOCK_M]. Smaller blocks of rows multiply and sum in fp32 registers, accumulator [BLOCK_M, BLOCK_N];
    under PDL they load their first W tile before the wait. The DOT path waits first and loads every W tile in
    its software-pipelined K loop.

    SPLIT > 1 (DOT, no prologue): program axis 2 splits K into SPLIT ranges of whole BLOCK_K tiles. Each program
    stores its fp32 partial in the workspace ws [SPLIT, M_PAD, N] and counts itself in its tile's counter
    (cnt_ptr, zero between launches); the tile's last program to arrive sums the partials in split order (the
    same sum whichever arrives last), writes y and sets the counter back to 0. One launch, deterministic.

    FP8 weights (WSCALE 1 per tensor, 2 per (SCALE_N, SCALE_K) block, BLOCK_K then dividing SCALE_K): each W tile
    is converted to a's dtype in registers (`_dequant_tile`), the per-tensor scale applied to the sums."""
    pid_n = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < N
    rows64 = rows.to(tl.int64)[:, None]
    cols64 = cols.to(tl.int64)[:, None]
    dtype = a_ptr.dtype.element_ty
    DOT: tl.constexpr = BLOCK_M >= 16
    FIRST: tl.constexpr = PDL and not DOT
    PLAIN: tl.constexpr = DOT and PRO == 0  # no prologue: a's tile goes to the MMA unconverted
    if FIRST:  # the first W tile (a constant) is loaded while the kernel before this one finishes
        first = tl.arange(0, BLOCK_K)
        w_first = tl.load(w_ptr + cols64 * s_w_n + first[None, :], mask=cmask[:, None] & (first < tl.minimum(GROUP, K))[None, :],
                          other=0.0)
    pdl_wait(PDL)
    NORM: tl.constexpr = PRO >= 2
    store_s = pid_n == 0  # add_norm: the first block of N stores s = residual + a
    if DOT:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SPLIT > 1:  # this program's range of K (GROUP = K: no prologue)
        k_per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT) * BLOCK_K
        k_lo = tl.program_id(2) * k_per
        k_hi = tl.minimum(K, k_lo + k_per)
    else:
        k_lo = 0
        k_hi = K
    for g0 in range(k_lo, k_hi, GROUP):  # one group (all of K) but for gated_norm
        g_end = tl.minimum(g0 + GROUP, k_hi)
        if DOT:
            part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in tl.range(g0, g_end, BLOCK_K, num_stages=STAGES):
            offs = k0 + tl.arange(0, BLOCK_K)
            kmask = offs < g_end
            mask = rmask[:, None] & kmask[None, :]
            if PLAIN:  # the MMA's operand as stored: [BLOCK_K, BLOCK_M], straight into shared memory
                xt = tl.load(a_ptr + rows.to(tl.int64)[None, :] * s_a_m + offs[:, None],
                             mask=rmask[None, :] & kmask[:, None], other=0.0)
            else:
                x = _prologue_raw(a_ptr, r_ptr, g_ptr, s_ptr, rows64, offs, mask, s_a_m, s_r_m, s_g_m, K, store_s,
                                  PRO)
            if NORM:  # the RMS scales the dot product, after it: x is weighted here and rounded once
                ss += tl.sum(x * x, axis=1)
                nw = tl.load(nw_ptr + offs, mask=kmask, other=0.0).to(tl.float32)
                x = round_to(nw[None, :] * x, a_ptr.dtype.element_ty).to(tl.float32)
            if FIRST:
                if k0 == 0:
                    w = w_first
                else:
                    w = tl.load(w_ptr + cols64 * s_w_n + offs[None, :], mask=cmask[:, None] & kmask[None, :],
                                other=0.0)
            else:
                w = tl.load(w_ptr + cols64 * s_w_n + offs[None, :], mask=cmask[:, None] & kmask[None, :], other=0.0)
            w = _dequant_tile(w, sc_ptr, cols, cmask, k0, s_sc_n, dtype, WSCALE, SCALE_N, SCALE_K)
            if PLAIN:
                if NATIVE_DOT:
                    part = tl.dot(w, xt, part)
                else:
                    part = tl.dot(w.to(tl.float32), xt.to(tl.float32), part, input_precision="ieee")
            elif DOT:
                if NATIVE_DOT:
                    part = tl.dot(w, tl.trans(x.to(dtype)), part)
                else:
                    part = tl.dot(w.to(tl.float32), tl.trans(x), part, input_precision="ieee")
            else:
                part += tl.sum(x[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        if NORM:
            scale = tl.math.rsqrt(tl.math.div_rn(ss, width) + eps)
            if DOT:  # noqa: SIM108 (a constexpr branch: the two shapes never meet in one expression)
                part = part * scale[None, :]
            else:
                part = part * scale[:, None]
        acc += part
    if WSCALE == 1:
        acc = acc * tl.load(sc_ptr)
    if SPLIT > 1:
        # Rows past M are in the workspace too (zeros: their a was masked), so the partials need no row mask.
        ws_tile = rows.to(tl.int64)[None, :] * N + cols[:, None]  # [BLOCK_N, BLOCK_M] within one split
        tl.store(ws_ptr + tl.program_id(2).to(tl.int64) * M_PAD * N + ws_tile, acc, mask=cmask[:, None])
        tile = tl.program_id(1) * tl.num_programs(0) + pid_n
        # acq_rel: this partial is visible before the count, and the last one sees every other partial.
        if tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel") == SPLIT - 1:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for sp in range(SPLIT):
                acc += tl.load(ws_ptr + sp * M_PAD * N + ws_tile, mask=cmask[:, None], other=0.0,
                               cache_modifier=".cg")
            if HAS_BIAS:
                acc += tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[:, None]
            tl.store(y_ptr + rows.to(tl.int64)[None, :] * s_y_m + cols[:, None],
                     round_to(acc, y_ptr.dtype.element_ty), mask=rmask[None, :] & cmask[:, None])
            tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed")  # for the next launch
    elif DOT:
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptr + rows.to(tl.int64)[None, :] * s_y_m + cols[:, None], round_to(acc, y_ptr.dtype.element_ty),
                 mask=rmask[None, :] & cmask[:, None])
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rows64 * s_y_m + cols[None, :], round_to(acc, y_ptr.dtype.element_ty),
                 mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _row_prologue(a_ptr, r_ptr, g_ptr, s_ptr, offs, mask, store_mask, PRO: tl.constexpr):
    """`_prologue_raw` for one row, as a [BLOCK_K] vector (s stored where store_mask)."""
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if PRO == 1:
        r = tl.maximum(a, 0.0)
        a = round_to(r * r, a_ptr.dtype.element_ty).to(tl.float32)
    elif PRO == 3:
        r = tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        a = round_to(a + r, a_ptr.dtype.element_ty)
        tl.store(s_ptr + offs, a, mask=store_mask)
        a = a.to(tl.float32)
    elif PRO == 4:
        z = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        a = a * tl.math.div_rn(z, 1.0 + tl.exp(-z))
    return a


@triton.jit
def _gemv_row_kernel(
    a_ptr, r_ptr, g_ptr, nw_ptr, s_ptr, w_ptr, b_ptr, y_ptr, sc_ptr,
    N, K, num_programs,
    s_w_n, s_sc_n,
    width, eps,
    PRO: tl.constexpr, HAS_BIAS: tl.constexpr, STEP: tl.constexpr, RESIDENT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr,
    WSCALE: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, SGK: tl.constexpr,
):  # fmt: skip
    """One row, persistent: `num_programs` programs, program p computing the blocks of N p, p + num_programs, ...
    in one loop, so that the software pipeliner keeps loading W across blocks (what a grid of short programs, one
    per block, cannot: their K loops are 2-4 tiles).

    RESIDENT (BLOCK_K >= K): f(a), its norm weights and RMS scale are computed once per program and stay in
    registers; each step is one [BLOCK_N, K] block of W. Otherwise the loop is flattened over (block of N, block
    of K), each step taking the next STEP channels of K in a BLOCK_K tile: STEP = BLOCK_K, or for gated_norm the
    group size (BLOCK_K >= it), one group per step; f(a) is recomputed per step (from L2).

    The products, norms and roundings are `_gemv_kernel`'s at BLOCK_M = 1 (flattened: in the same order;
    resident: the whole row's products summed at once and, for gated_norm, the groups' scaled sums added as a
    tree instead of one by one).

    FP8 weights (`_row_dot`): e4m3 loaded and widened to fp32 in registers; block-wise (WSCALE 2, not with
    gated_norm) the products are summed per SGK channels and each sum scaled by its block's scale; per tensor
    (WSCALE 1) the block's sum is scaled once."""
    pid = tl.program_id(0)
    pdl_wait_only(PDL)
    NORM: tl.constexpr = PRO >= 2
    GATED: tl.constexpr = PRO == 4
    n_tiles = tl.cdiv(N, BLOCK_N)
    dtype = a_ptr.dtype.element_ty
    if WSCALE == 1:  # noqa: SIM108 (a constexpr branch)
        w_scale = tl.load(sc_ptr)
    else:
        w_scale = 1.0
    if RESIDENT:
        offs = tl.arange(0, BLOCK_K)
        kmask = offs < K
        x = _row_prologue(a_ptr, r_ptr, g_ptr, s_ptr, offs, kmask, kmask & (offs < tl.where(pid == 0, K, 0)), PRO)
        if NORM:
            nw = tl.load(nw_ptr + offs, mask=kmask, other=0.0).to(tl.float32)
            xw = round_to(nw * x, dtype).to(tl.float32)
            if GATED:  # one RMS scale per group of STEP channels
                ss_g = tl.sum(tl.reshape(x * x, (BLOCK_K // STEP, STEP)), axis=1)
                scale = tl.math.rsqrt(tl.math.div_rn(ss_g, width) + eps)
            else:
                scale = tl.math.rsqrt(tl.math.div_rn(tl.sum(x * x, axis=0), width) + eps)
        else:
            xw = x
        for tile in tl.range(pid, n_tiles, num_programs, num_stages=STAGES):
            cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            w = tl.load(w_ptr + cols.to(tl.int64)[:, None] * s_w_n + offs[None, :],
                        mask=(cols < N)[:, None] & kmask[None, :], other=0.0)
            if GATED:
                prod = w.to(tl.float32) * xw[None, :]
                acc = tl.sum(tl.sum(tl.reshape(prod, (BLOCK_N, BLOCK_K // STEP, STEP)), axis=2) * scale[None, :],
                             axis=1)
            else:
                acc = _row_dot(w, xw, sc_ptr, cols, cols < N, 0, K, s_sc_n, WSCALE, SCALE_N, SCALE_K, SGK, BLOCK_N,
                               BLOCK_K)
                if NORM:
                    acc = acc * scale
            if WSCALE == 1:
                acc = acc * w_scale
            if HAS_BIAS:
                acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
            tl.store(y_ptr + cols, round_to(acc, y_ptr.dtype.element_ty), mask=cols < N)
    else:
        k_tiles = tl.cdiv(K, STEP)
        my_tiles = tl.cdiv(n_tiles - pid, num_programs)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        ss = 0.0
        for it in tl.range(0, my_tiles * k_tiles, num_stages=STAGES):
            ki = it % k_tiles
            tile = pid + (it // k_tiles) * num_programs
            offs = ki * STEP + tl.arange(0, BLOCK_K)
            if STEP == BLOCK_K:  # noqa: SIM108 (a constexpr branch, as measured on the GPUs)
                kmask = offs < K
            else:
                kmask = (tl.arange(0, BLOCK_K) < STEP) & (offs < K)
            x = _row_prologue(a_ptr, r_ptr, g_ptr, s_ptr, offs, kmask, kmask & (offs < tl.where(tile == 0, K, 0)),
                              PRO)
            cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            w = tl.load(w_ptr + cols.to(tl.int64)[:, None] * s_w_n + offs[None, :],
                        mask=(cols < N)[:, None] & kmask[None, :], other=0.0)
            if NORM:
                nw = tl.load(nw_ptr + offs, mask=kmask, other=0.0).to(tl.float32)
                xw = round_to(nw * x, dtype).to(tl.float32)
                if GATED:  # this step is the group: its RMS scales its products at once
                    acc += tl.sum(w.to(tl.float32) * xw[None, :], axis=1) * tl.math.rsqrt(
                        tl.math.div_rn(tl.sum(x * x, axis=0), width) + eps)
                else:
                    ss += tl.sum(x * x, axis=0)
                    acc += _row_dot(w, xw, sc_ptr, cols, cols < N, ki * STEP, K, s_sc_n, WSCALE, SCALE_N, SCALE_K,
                                    SGK, BLOCK_N, BLOCK_K)
            else:
                acc += _row_dot(w, x, sc_ptr, cols, cols < N, ki * STEP, K, s_sc_n, WSCALE, SCALE_N, SCALE_K, SGK,
                                BLOCK_N, BLOCK_K)
            if ki == k_tiles - 1:  # the block of N's last step
                if NORM and not GATED:
                    acc = acc * tl.math.rsqrt(tl.math.div_rn(ss, width) + eps)
                    ss = 0.0
                if WSCALE == 1:
                    acc = acc * w_scale
                if HAS_BIAS:
                    acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
                tl.store(y_ptr + cols, round_to(acc, y_ptr.dtype.element_ty), mask=cols < N)
                acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    pdl_launch_next(PDL)


@dataclass(frozen=True)
class GemvTiles:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    # Software-pipeline stages of the K loop (3: Triton's own default on CUDA, what every tile was tuned with).
    num_stages: int = 3
    # > 0: one row only, `_gemv_row_kernel` with this many programs per SM (one under the interpreter), each
    # looping over blocks of N; 0: one program per block of N.
    programs_per_sm: int = 0
    # True: the op before the layer runs as its own kernel (ops.norm / ops.act), then the GEMM with no
    # prologue, because on the tensor-core path (block_m >= 16) f(a) inside the K loop costs more than it saves.
    prologue_apart: bool = False
    # With prologue_apart: the GEMM by cuBLAS (F.linear) instead, for shapes where the Triton GEMM is not faster
    # (no default tile takes it; kept for sweeps).
    cublas: bool = False
    # > 1 (block_m >= 16, no prologue): K split over this many programs per block of N, their partials summed by
    # the last to finish (`_gemv_kernel`); for layers with few blocks of N and a long K.
    split_k: int = 1


def default_tiles(m: int, n: int, k: int, on_cuda: bool, itemsize: int = 2) -> GemvTiles:
    """Tiles for M rows of `itemsize`-byte inputs. One row on the GPU: the persistent row kernel. 2-64 rows: one
    block of rows (padded to 16, the MMA's short side), so that W is read once, on the tensor cores; wide layers
    (N > 8192) in blocks of 64 x 128 with 3 stages, narrow ones in 32 x 256 with 4 (enough programs for the SMs);
    narrow ones with K > 4096 (out_proj, down_proj) in 64 x 256 with 4, K split in two past 8192. 33-64 rows: one
    block of 64 rows, whose a tile is as large as a 64-wide W tile, so the wide layers (in_proj, up_proj) take
    64-long K tiles with 4 stages, lm_head 128 with 3, and K > 4096 splits in two; chosen by whole decode steps,
    where our kernels chaining by PDL outweighs a layer's own time against cuBLAS. Each tile is the best of a sweep
    on a GPU (`benchmarks/RESULTS.md`). Past 64 rows each block of rows reads the whole weight again:
    cuBLAS is the better choice there."""
    if not on_cuda:  # interpreter: few, large programs
        return GemvTiles(16 if m > 4 else max(1, next_power_of_2(m)), min(64, next_power_of_2(n)),
                         min(128, next_power_of_2(k)), 4)
    if m == 1:  # persistent, f(a) resident up to K = 8192; the best tile of a sweep
        kp = next_power_of_2(k)
        return GemvTiles(1, 2, kp, 8, 3, programs_per_sm=2) if kp <= 8192 else GemvTiles(1, 8, 2048, 4, 3, 2)
    block_m = min(64, max(16, next_power_of_2(m)))
    if block_m > 32:  # 33-64 rows: short K tiles for the wide layers (a's tile is as large as W's), K split in two
        # past 4096, the best of a sweep in whole decode steps
        if k > 4096:
            return GemvTiles(block_m, 64, 256 // itemsize, 4, 4, prologue_apart=True, split_k=2)
        wide = 8192 < n <= 32768  # in_proj, up_proj (lm_head keeps 128-wide K tiles, 3 stages)
        return GemvTiles(block_m, 64, (128 if wide else 256) // itemsize, 4, 3 if n > 32768 else 4,
                         prologue_apart=True)
    if n > 8192:
        return GemvTiles(block_m, 64, 128, 4, 3, prologue_apart=True)
    if k > 4096:  # few blocks of N, long K: wider tiles, K split in two past 8192 (out_proj, down_proj); the
        # same bytes per stage for 4-byte inputs (a K tile of 256 would outgrow shared memory)
        return GemvTiles(block_m, 64, 512 // itemsize, 4, 4, prologue_apart=True, split_k=2 if k > 8192 else 1)
    return GemvTiles(block_m, 32, 256, 4, 4, prologue_apart=True)


def _prologue_apart(a: Tensor, prologue: str, residual: Tensor | None, gate: Tensor | None,
                    norm_weight: Tensor | None, eps: float, group_size: int | None) -> tuple[Tensor, Tensor | None]:
    """f(a) by the op's own Triton kernel (the separate ops of a step without fused GEMVs), and s for add_norm."""
    if prologue == "none":
        return a, None
    if prologue == "relu2":
        return relu2_triton(a), None
    if prologue == "norm":
        return rms_norm_triton(a, norm_weight, eps), None
    if prologue == "add_norm":
        return add_rms_norm_triton(a, residual, norm_weight, eps)
    return gated_rms_norm_triton(a, gate, norm_weight, group_size, eps).to(a.dtype), None


# Split-K tile counters per device: zero between launches (each launch's last programs set theirs back). Kernels on
# one stream run one after the other (under PDL each waits for the one before it before touching them).
_COUNTERS: dict[torch.device, Tensor] = {}
COUNTERS_MIN = 4096


def _split_buffers(t: GemvTiles, placeholder: Tensor, grid: tuple[int, int, int], m_pad: int, n: int,
                   prologue: str, fn: str) -> tuple[Tensor, Tensor]:
    """(workspace [split, m_pad, n] fp32, tile counters) of a split-K launch; without a split, the placeholder
    twice (never read)."""
    if t.split_k == 1:
        return placeholder, placeholder
    device = placeholder.device
    if t.split_k < 1 or t.block_m < 16 or prologue != "none":
        raise ValueError(f"{fn}: split_k > 1 expected block_m >= 16 and no prologue, got split_k {t.split_k}, "
                         f"block_m {t.block_m}, prologue {prologue!r}")
    tiles = grid[0] * grid[1]
    cnt = _COUNTERS.get(device)
    if cnt is None or cnt.numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # (a fresh buffer made inside a capture would be the graph's, zeroed by it on every replay)
            raise RuntimeError(f"{fn}: the split-K counters for {tiles} tiles must exist before a CUDA graph "
                               "capture: run the layer once first (the capture's warm-up does)")
        cnt = _COUNTERS[device] = torch.zeros(max(COUNTERS_MIN, tiles), dtype=torch.int32, device=device)
    return torch.empty((t.split_k, m_pad, n), dtype=torch.float32, device=device), cnt


def _num_sms(device: torch.device) -> int:
    """The device's SM count (cached); 1 on CPU (the interpreter)."""
    return sm_count(device) if device.type == "cuda" else 1


def _rows(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 or t.shape[0] == 0 else t.contiguous()


def _scale_args(fn: str, weight_scale: Tensor | None, block: tuple[int, int] | None,
                placeholder: Tensor) -> tuple[int, Tensor, int]:
    """(WSCALE: 0 16-bit, 1 per tensor, 2 block-wise; the fp32 scales; their row stride) of a weight."""
    if weight_scale is None:
        return 0, placeholder, 0
    sc = weight_scale if weight_scale.dtype == torch.float32 else weight_scale.float()
    if block is None:
        return 1, sc.reshape(1), 0
    if block[1] & (block[1] - 1):
        raise ValueError(f"{fn}: block expected a power-of-two width (K), got {block}")
    sc = sc.contiguous()
    return 2, sc, sc.stride(0)


def fused_linear_triton(a: Tensor, weight: Tensor, bias: Tensor | None = None, *, prologue: str = "none",
                        residual: Tensor | None = None, gate: Tensor | None = None, norm_weight: Tensor | None = None,
                        eps: float = 1e-5, group_size: int | None = None, tiles: GemvTiles | None = None,
                        weight_scale: Tensor | None = None,
                        block: tuple[int, int] | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """y = f(a) @ weight^T (+ bias) in one launch; see `ops.linear.reference.fused_linear`. An FP8 weight
    (float8_e4m3fn) comes with `weight_scale` (per tensor, or per `block`) and is dequantized in registers; with
    gated_norm its norm runs apart (`ops.norm.kernel`) first."""
    fn = "fused_linear_triton"
    check_fused_linear(fn, a, weight, bias, prologue, residual, gate, norm_weight, group_size, weight_scale, block)
    fp8 = {} if weight_scale is None else {"weight_scale": weight_scale, "block": block}
    if fp8 and prologue == "gated_norm":  # (the row kernel's per-group sums of both would not line up)
        x, _ = _prologue_apart(a, prologue, residual, gate, norm_weight, eps, group_size)
        return fused_linear_triton(x, weight, bias, tiles=tiles, **fp8)
    m, k = a.shape
    n = weight.shape[0]
    a = _rows(a)
    w = weight if weight.stride(1) == 1 else weight.contiguous()
    r = a if residual is None else _rows(residual)
    g = a if gate is None else _rows(gate)
    y = torch.empty((m, n), dtype=a.dtype, device=a.device)
    s = torch.empty((m, k), dtype=a.dtype, device=a.device) if prologue == "add_norm" else None
    t = tiles or default_tiles(m, n, k, a.is_cuda, a.element_size())
    if t.programs_per_sm and m > 1:
        raise ValueError(f"{fn}: tiles with programs_per_sm > 0 expected one row, got {m} rows")
    if t.prologue_apart and (prologue != "none" or t.cublas):
        x, s = _prologue_apart(a, prologue, residual, gate, norm_weight, eps, group_size)
        if t.cublas and fp8:
            raise ValueError(f"{fn}: cublas tiles expected a 16-bit weight, got {weight.dtype}")
        if t.cublas:
            y = torch.nn.functional.linear(x, weight, bias)
        else:
            y = fused_linear_triton(x, weight, bias, tiles=dataclasses.replace(t, prologue_apart=False), **fp8)
        return y if s is None else (y, s)
    wscale, sc, s_sc = _scale_args(fn, weight_scale, block, a)
    scale_n, scale_k = block or (1, 1)
    if m and n:
        group = group_size if prologue == "gated_norm" else max(k, 1)
        nw = norm_weight.contiguous() if norm_weight is not None else a
        gated = prologue == "gated_norm"
        # resident: the tile covers K (gated_norm: in whole groups of a power-of-two size); else gated_norm takes one
        # group per step, in a tile of at least its size
        resident = t.block_k >= k and (not gated or group & (group - 1) == 0)
        block_k = next_power_of_2(k) if resident else next_power_of_2(group) if gated else t.block_k
        if t.programs_per_sm and block_k * t.block_n <= 32768:  # else the tile outgrows a program: one per block
            programs = min(cdiv(n, t.block_n), t.programs_per_sm * _num_sms(a.device))
            _gemv_row_kernel[(programs,)](
                a, r, g, nw, a if s is None else s, w, a if bias is None else bias, y, sc,
                n, k, programs, w.stride(0), s_sc, float(group), eps,
                PRO=_CODES[prologue], HAS_BIAS=bias is not None, STEP=group if gated else block_k, RESIDENT=resident,
                BLOCK_N=t.block_n, BLOCK_K=block_k, STAGES=t.num_stages,
                WSCALE=wscale, SCALE_N=scale_n, SCALE_K=scale_k, SGK=min(scale_k, block_k),
                num_warps=t.num_warps, num_stages=t.num_stages, **pdl(a),
            )  # fmt: skip
            return y if s is None else (y, s)
        if wscale == 2:  # each K tile within one block of the scales
            t = dataclasses.replace(t, block_k=min(t.block_k, scale_k))
        grid = (cdiv(n, t.block_n), cdiv(m, t.block_m), t.split_k)
        m_pad = grid[1] * t.block_m
        ws, cnt = _split_buffers(t, a, grid, m_pad, n, prologue, fn)
        _gemv_kernel[grid](
            a, r, g, nw, a if s is None else s, w, a if bias is None else bias, y, ws, cnt, sc,
            m, n, k, group, m_pad, a.stride(0), r.stride(0), g.stride(0), w.stride(0), y.stride(0), s_sc,
            float(group), eps,
            PRO=_CODES[prologue], HAS_BIAS=bias is not None, NATIVE_DOT=a.dtype != torch.float32 and not _interpreted(),
            SPLIT=t.split_k, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, STAGES=t.num_stages,
            WSCALE=wscale, SCALE_N=scale_n, SCALE_K=scale_k,
            num_warps=t.num_warps, num_stages=t.num_stages, **pdl(a),
        )  # fmt: skip
    elif s is not None and m:
        s.copy_(residual + a)
    return y if s is None else (y, s)
