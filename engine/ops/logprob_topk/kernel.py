"""Triton kernels for `logprobs.pack` (the torch reference): per row of logits, the log-softmax normaliser, the chosen
token's logprob and the k best alternatives, from one read of the logits instead of the reference's float32
log-softmax [L, V] and its top-k.

`_slice_kernel`: one program per (row, slice of V). In one pass over its slice it keeps the slice's maximum and
the sum of exp(x - max) (an online softmax: each lane's sum rescaled when its maximum grows), and its k best ids,
ordered by value, ties by lowest id, in a register tile: a block's ids go through the tile only where they beat its
worst, so after the first blocks most blocks cost one comparison per id. `_pack_kernel`: one program per row merges
the slices' sums into log Z = max + log(sum) and their candidates into the row's k best (the same order), and
writes the packed row: the token, x_token - max - log(sum), the alternatives' logprobs and ids.

The sum runs in another order than torch's, so a logprob differs from the reference's within float32 rounding
(of log Z, shared by the row); the alternatives are the reference's ids where their values differ (ties: the lowest
ids, where torch's order is unspecified). Graph-capturable; no host reads.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from baton.engine.logprobs import pack
from baton.engine.ops.logprob_topk.tuning import (
    BLOCK,
    MAX_K,
    MAX_SPLITS,
    MIN_BLOCKS_PER_SPLIT,
    PROGRAMS_PER_SM,
)
from baton.engine.ops.triton_common import cdiv, next_power_of_2, sm_count

_NO_ID = tl.constexpr(2 ** 31 - 1)  # (an empty slot's id: loses every tie)


@triton.jit
def _worst(tv, ti):
    """The tile's worst entry (least value, then highest id): its value and id."""
    wv = tl.min(tv, axis=0)
    return wv, tl.max(tl.where(tv == wv, ti, -1), axis=0)


@triton.jit
def _slice_kernel(x_ptr, stats_ptr, cv_ptr, ci_ptr, V, S, span, x_row, K: tl.constexpr, KP: tl.constexpr,
                  BLOCK: tl.constexpr):
    row = tl.program_id(0)
    q = tl.program_id(1)
    v0 = q * span
    v1 = tl.minimum(v0 + span, V)
    src = x_ptr + row.to(tl.int64) * x_row
    offs = tl.arange(0, BLOCK)
    kk = tl.arange(0, KP)
    # Slots from K on hold +inf: never the worst, never taken.
    tv = tl.where(kk < K, float("-inf"), float("inf"))
    ti = tl.where(kk < K, _NO_ID, -1)
    wv, wi = _worst(tv, ti)
    mx = tl.full([BLOCK], float("-inf"), tl.float32)
    acc = tl.zeros([BLOCK], tl.float32)
    for off in range(v0, v1, BLOCK):
        i = off + offs
        live = i < v1
        x = tl.load(src + i, mask=live, other=float("-inf")).to(tl.float32)
        new = tl.maximum(mx, x)
        ref = tl.where(new > float("-inf"), new, 0.0)  # (a lane that has seen only -inf: no -inf - -inf)
        acc = acc * tl.exp(mx - ref) + tl.exp(x - ref)
        mx = new
        if K > 0:
            # Earlier ids are lower: an id beats the worst by value, or ties it while the worst is an empty slot.
            cand = live & ((x > wv) | ((x == wv) & (wi == _NO_ID)))
            n = tl.sum(cand.to(tl.int32), axis=0)
            while n > 0:
                bv = tl.max(tl.where(cand, x, float("-inf")), axis=0)
                bi = tl.min(tl.where(cand & (x == bv), i, _NO_ID), axis=0)
                slot = tl.min(tl.where((tv == wv) & (ti == wi), kk, KP), axis=0)
                tv = tl.where(kk == slot, bv, tv)
                ti = tl.where(kk == slot, bi, ti)
                wv, wi = _worst(tv, ti)
                cand = cand & (i != bi) & ((x > wv) | ((x == wv) & (wi == _NO_ID)))
                n = tl.sum(cand.to(tl.int32), axis=0)
    m = tl.max(mx, axis=0)
    s = tl.sum(acc * tl.exp(mx - tl.where(m > float("-inf"), m, 0.0)), axis=0)
    at = row * S + q
    tl.store(stats_ptr + at * 2, m)
    tl.store(stats_ptr + at * 2 + 1, s)
    if K > 0:
        tl.store(cv_ptr + at * KP + kk, tv)
        tl.store(ci_ptr + at * KP + kk, ti)


@triton.jit
def _pack_kernel(x_ptr, tok_ptr, stats_ptr, cv_ptr, ci_ptr, out_ptr, S, x_row, K: tl.constexpr, KP: tl.constexpr,
                 SP: tl.constexpr):
    row = tl.program_id(0)
    s = tl.arange(0, SP)
    ms = tl.load(stats_ptr + (row * S + s) * 2, mask=s < S, other=float("-inf"))
    ss = tl.load(stats_ptr + (row * S + s) * 2 + 1, mask=s < S, other=0.0)
    m = tl.max(ms, axis=0)
    log_z = tl.log(tl.sum(tl.where(ms > float("-inf"), ss * tl.exp(ms - m), 0.0), axis=0))
    dst = out_ptr + row.to(tl.int64) * (2 + 2 * K)
    tok = tl.load(tok_ptr + row)
    x = tl.load(x_ptr + row.to(tl.int64) * x_row + tok).to(tl.float32)
    tl.store(dst, tok.to(tl.float32))
    tl.store(dst + 1, (x - m) - log_z)
    if K > 0:
        c = tl.arange(0, SP * KP)
        have = (c < S * KP) & (c % KP < K)  # (slots from K on are padding)
        cv = tl.load(cv_ptr + row * S * KP + c, mask=have, other=float("-inf"))
        ci = tl.load(ci_ptr + row * S * KP + c, mask=have, other=_NO_ID)
        for t in tl.static_range(K):
            bv = tl.max(tl.where(have, cv, float("-inf")), axis=0)
            bi = tl.min(tl.where(have & (cv == bv), ci, _NO_ID), axis=0)
            tl.store(dst + 2 + t, (bv - m) - log_z)
            tl.store(dst + 2 + K + t, bi.to(tl.float32))
            have = have & ((ci != bi) | (cv != bv))


def auto_splits(rows: int, V: int, device: torch.device) -> int:
    """Slices of V per row: enough programs to fill the GPU, none shorter than a few blocks."""
    if device.type != "cuda":
        return 1
    most = max(1, min(MAX_SPLITS, V // (BLOCK * MIN_BLOCKS_PER_SPLIT)))
    return max(1, min(most, cdiv(PROGRAMS_PER_SM * sm_count(device), rows)))


def pack_triton(logits: Tensor, tokens: Tensor, k: int, splits: int | None = None) -> Tensor:
    """`logprobs.pack` in two launches: logits [L, V] (any float dtype), tokens [L] (any int dtype), 0 <= k <= V
    -> [L, 2 + 2k] float32. More than `MAX_K` alternatives take the reference. `splits`: slices of V per row
    (None: enough to fill the device)."""
    if logits.dim() != 2 or tokens.shape != logits.shape[:1]:
        raise ValueError(f"logits, tokens: expected [L, V] and [L], got {tuple(logits.shape)} and "
                         f"{tuple(tokens.shape)}")
    L, V = logits.shape
    if not 0 <= k <= V:
        raise ValueError(f"k: expected 0..{V} (the vocabulary), got {k}")
    if k > MAX_K:
        return pack(logits, tokens, k)
    dev = logits.device
    out = torch.empty(L, 2 + 2 * k, dtype=torch.float32, device=dev)
    if L == 0:
        return out
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    tokens = tokens.to(torch.int64).contiguous()
    S = splits if splits is not None else auto_splits(L, V, dev)
    if not 1 <= S <= MAX_SPLITS:
        raise ValueError(f"splits: expected 1..{MAX_SPLITS}, got {S}")
    span = cdiv(cdiv(V, S), BLOCK) * BLOCK
    S = cdiv(V, span)
    KP = max(2, next_power_of_2(k))
    stats = torch.empty(L * S * 2, dtype=torch.float32, device=dev)
    cv = torch.empty(L * S * KP, dtype=torch.float32, device=dev)
    ci = torch.empty(L * S * KP, dtype=torch.int32, device=dev)
    _slice_kernel[(L, S)](logits, stats, cv, ci, V, S, span, logits.stride(0), K=k, KP=KP, BLOCK=BLOCK,
                          num_warps=4)
    _pack_kernel[(L,)](logits, tokens, stats, cv, ci, out, S, logits.stride(0), K=k, KP=KP,
                       SP=max(2, next_power_of_2(S)), num_warps=4)
    return out
