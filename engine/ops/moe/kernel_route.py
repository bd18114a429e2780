"""MoE routing as one Triton kernel per layer: a program per token reads its row of router logits and writes its
top-k expert ids and weights, where the torch reference (`reference.route_sigmoid_grouped`, `route_softmax`) runs
about a dozen small launches (sigmoid, bias, two top-k's, masks, gather, sums). At decode batch sizes those launches,
not their bytes, are the cost.

Both routers of `reference.py`: NemotronH's (sigmoid scores; experts picked by score + correction bias among the
`topk_group` groups whose two best biased scores sum highest; weights the unbiased scores of the picked, renormalised
when asked, times the scaling factor) and Qwen3.5-MoE / Qwen3-Next's (fp32 softmax over all experts, its top-k,
renormalised when asked). The top-k is k rounds of max-and-remove over the row in registers; on equal values the lower
expert id wins (torch's top-k leaves that order unspecified, and the expert kernels do not depend on the order of a
token's k picks). Ids come out int64 and weights fp32, as the reference's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from baton.engine.ops.triton_common import next_power_of_2

# NemotronH's renormalisation adds this to the sum (as the reference does); Qwen's divides by the sum as it is.
SIGMOID_NORM_EPS = 1e-20


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, idx_ptr, w_ptr, E, s_lt, scale, eps,
                  GROUP_SIZE: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, NG_P: tl.constexpr,
                  TOP_K: tl.constexpr, K_P: tl.constexpr, SIGMOID: tl.constexpr, NORM: tl.constexpr,
                  BLOCK_E: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < E
    x = tl.load(logits_ptr + t * s_lt + offs, mask=valid, other=0.0).to(tl.float32)
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-x))
        bias = tl.load(bias_ptr + offs, mask=valid, other=0.0).to(tl.float32)
        choice = tl.where(valid, scores + bias, float("-inf"))
    else:
        m = tl.max(tl.where(valid, x, float("-inf")), axis=0)
        ex = tl.where(valid, tl.exp(x - m), 0.0)
        scores = ex / tl.sum(ex, axis=0)
        choice = tl.where(valid, scores, float("-inf"))
    if N_GROUP > 1:
        # Each group's score: the sum of its two best biased scores; then the TOPK_GROUP best groups stay.
        group = offs // GROUP_SIZE
        gids = tl.arange(0, NG_P)
        gscore = tl.full([NG_P], float("-inf"), tl.float32)
        for g in tl.static_range(N_GROUP):
            c = tl.where(group == g, choice, float("-inf"))
            m1 = tl.max(c, axis=0)
            i1 = tl.min(tl.where(c == m1, offs, BLOCK_E), axis=0)
            m2 = tl.max(tl.where(offs == i1, float("-inf"), c), axis=0)
            gscore = tl.where(gids == g, m1 + m2, gscore)
        keep = offs < 0
        for _ in tl.static_range(TOPK_GROUP):
            gm = tl.max(gscore, axis=0)
            gi = tl.min(tl.where(gscore == gm, gids, NG_P), axis=0)
            keep = keep | (group == gi)
            gscore = tl.where(gids == gi, float("-inf"), gscore)
        choice = tl.where(keep, choice, float("-inf"))
    kids = tl.arange(0, K_P)
    picked = tl.zeros([K_P], tl.int64)
    weights = tl.zeros([K_P], tl.float32)
    for k in tl.static_range(TOP_K):
        cm = tl.max(choice, axis=0)
        ci = tl.min(tl.where(choice == cm, offs, BLOCK_E), axis=0)
        w = tl.sum(tl.where(offs == ci, scores, 0.0), axis=0)
        picked = tl.where(kids == k, ci.to(tl.int64), picked)
        weights = tl.where(kids == k, w, weights)
        choice = tl.where(offs == ci, float("-inf"), choice)
    if NORM:
        weights = weights / (tl.sum(weights, axis=0) + eps)
    out = kids < TOP_K
    tl.store(idx_ptr + t * TOP_K + kids, picked, mask=out)
    tl.store(w_ptr + t * TOP_K + kids, weights * scale, mask=out)


def _check(fn: str, logits: Tensor, top_k: int, allowed: int) -> None:
    if logits.dim() != 2:
        raise ValueError(f"{fn}: logits expected [T, E], got shape {tuple(logits.shape)}")
    if not 1 <= top_k <= allowed:
        raise ValueError(f"{fn}: top_k expected 1..{allowed} (the experts a token may pick), got {top_k}")


def _launch(logits: Tensor, bias: Tensor | None, top_k: int, n_group: int, topk_group: int, sigmoid: bool,
            norm: bool, scale: float, eps: float) -> tuple[Tensor, Tensor]:
    T, E = logits.shape
    idx = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    if T == 0:
        return idx, weights
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    _route_kernel[(T,)](
        logits, logits if bias is None else bias, idx, weights, E, logits.stride(0), float(scale), float(eps),
        GROUP_SIZE=E // n_group, N_GROUP=n_group, TOPK_GROUP=topk_group, NG_P=next_power_of_2(n_group),
        TOP_K=top_k, K_P=next_power_of_2(top_k), SIGMOID=sigmoid, NORM=norm, BLOCK_E=next_power_of_2(E),
        num_warps=4 if E <= 1024 else 8,
    )  # fmt: skip
    return idx, weights


def route_sigmoid_grouped_triton(logits: Tensor, correction_bias: Tensor, n_group: int, topk_group: int, top_k: int,
                                 norm_topk_prob: bool, routed_scaling_factor: float) -> tuple[Tensor, Tensor]:
    """`reference.route_sigmoid_grouped` in one launch: (expert ids [T, top_k] int64, weights [T, top_k] fp32)."""
    fn = "route_sigmoid_grouped_triton"
    e = logits.shape[-1]
    if n_group < 1 or e % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(f"{fn}: expected n_group dividing the {e} experts and 1 <= topk_group <= n_group, got "
                         f"n_group {n_group}, topk_group {topk_group}")
    _check(fn, logits, top_k, topk_group * (e // n_group))
    if tuple(correction_bias.shape) != (e,):
        raise ValueError(f"{fn}: correction_bias expected shape ({e},), got {tuple(correction_bias.shape)}")
    return _launch(logits, correction_bias.contiguous(), top_k, n_group, topk_group, True, norm_topk_prob,
                   routed_scaling_factor, SIGMOID_NORM_EPS)


def route_softmax_triton(logits: Tensor, top_k: int, norm_topk_prob: bool) -> tuple[Tensor, Tensor]:
    """`reference.route_softmax` in one launch: (expert ids [T, top_k] int64, weights [T, top_k] fp32)."""
    _check("route_softmax_triton", logits, top_k, logits.shape[-1])
    return _launch(logits, None, top_k, 1, 1, False, norm_topk_prob, 1.0, 0.0)
