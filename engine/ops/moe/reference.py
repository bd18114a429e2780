"""The torch reference of the routed experts, in the shape the kernels run it (also the CPU path, `ops.kernels`),
and the routing both paths share.

Routing (`route_sigmoid_grouped` for NemotronH, `route_softmax` for Qwen3.5-MoE / Qwen3-Next) is torch ops here, the
CPU path and the reference of the routing kernel (`kernel_route.py`, one launch a layer on CUDA). `align_reference`
sorts the T * top_k (token, expert) rows by expert, stable in row order, each expert's rows padded to a multiple of
`block_m`, into arrays of a size known from T alone (`max_padded_rows`). `moe_experts_reference` runs each expert's
rows through up, the activation and down, scales each row by its routing weight (fp32, rounded to x's dtype, as the
kernel stores it) and sums each token's top-k rows in fp32. It reads the expert segments on the host (one sync),
which the kernels never do.

FP8 experts (weight-only, float8_e4m3fn stacks with fp32 scales, `layers.fp8_experts`): a stack's rows are `parts`
equal segments (2 for a gated `[E, 2I, d]` stack: the gate rows and the up rows, quantized apart as the checkpoints
store them; else 1), each with its own scales: one per expert and segment (`[E]`, gated `[E, 2]`), or one per
(block[0], block[1]) block of each segment (`[E, parts * ceil(rows / parts / block[0]), ceil(cols / block[1])]`).
The reference dequantizes each expert it runs to fp32 and rounds it once to x's dtype: what the model whose
checkpoint held the dequantized experts computes, bit for bit.
"""

from __future__ import annotations

import torch
from torch import Tensor

from baton.engine.ops.act.reference import relu2_reference
from baton.engine.ops.fp8_linear.reference import (
    FP8_DTYPE,
    dequantize,
    quantize_blockwise,
    quantize_per_tensor,
)

ACTIVATIONS = ("relu2", "relu", "silu", "gelu")


def route_sigmoid_grouped(logits: Tensor, correction_bias: Tensor, n_group: int, topk_group: int, top_k: int,
                          norm_topk_prob: bool, routed_scaling_factor: float) -> tuple[Tensor, Tensor]:
    """NemotronH's router: sigmoid scores; experts chosen by score + correction bias among the `topk_group` groups
    whose two best biased scores sum highest; weights are the unbiased scores of the chosen, renormalised when
    `norm_topk_prob`, times `routed_scaling_factor`. (expert ids [T, top_k] int64, weights [T, top_k] fp32)"""
    e = logits.shape[-1]
    scores = logits.float().sigmoid()  # [T, E]
    choice = scores + correction_bias
    group_scores = choice.view(-1, n_group, e // n_group).topk(2, dim=-1)[0].sum(-1)  # [T, n_group]
    group_idx = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
    expert_mask = group_mask.unsqueeze(-1).expand(-1, n_group, e // n_group).reshape(-1, e)
    choice = choice.masked_fill(expert_mask == 0, float("-inf"))
    idx = choice.topk(top_k, dim=-1, sorted=False)[1]  # [T, k]
    weights = scores.gather(1, idx)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return idx, weights * routed_scaling_factor


def route_softmax(logits: Tensor, top_k: int, norm_topk_prob: bool) -> tuple[Tensor, Tensor]:
    """Qwen3.5-MoE / Qwen3-Next's router: fp32 softmax over all experts, its top-k, renormalised over them when
    `norm_topk_prob`. (expert ids [T, top_k] int64, weights [T, top_k] fp32)"""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, idx = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return idx, weights


def max_padded_rows(num_rows: int, num_experts: int, block_m: int) -> int:
    """The most sorted rows the padding can make of `num_rows` (token, expert) rows: each of at most
    min(num_experts, num_rows) non-empty experts adds fewer than block_m rows."""
    return num_rows + min(num_experts, num_rows) * (block_m - 1)


def expert_scale_shape(shape: tuple[int, ...], block: tuple[int, int] | None, parts: int) -> tuple[int, ...]:
    """The scales' shape of an FP8 expert stack of `shape` [E, rows, cols] in `parts` segments (module docstring)."""
    e, n, k = shape
    if block is None:
        return (e,) if parts == 1 else (e, parts)
    return e, parts * -(-(n // parts) // block[0]), -(-k // block[1])


def check_expert_scale(fn: str, name: str, w: Tensor, scale: Tensor | None, block: tuple[int, int] | None,
                       parts: int) -> None:
    """An FP8 stack has its scales of `expert_scale_shape`, a 16-bit one none (ValueError: expected vs got)."""
    if (w.dtype == FP8_DTYPE) != (scale is not None):
        raise ValueError(f"{fn}: {name}_scale expected with (and only with) a {FP8_DTYPE} {name}, got a {w.dtype} "
                         f"{name} and {'no' if scale is None else 'a'} {name}_scale")
    if scale is None:
        return
    if block is not None and (len(block) != 2 or min(block) <= 0):
        raise ValueError(f"{fn}: block expected two positive sizes, got {block}")
    want = expert_scale_shape(tuple(w.shape), block, parts)
    if tuple(scale.shape) != want:
        raise ValueError(f"{fn}: {name}_scale expected shape {want} for {name} {tuple(w.shape)} and block {block}, "
                         f"got {tuple(scale.shape)}")
    if scale.device != w.device:
        raise ValueError(f"{fn}: {name}_scale on {scale.device}, {name} on {w.device}")


def dequantize_expert(w: Tensor, scale: Tensor, block: tuple[int, int] | None, parts: int) -> Tensor:
    """One expert's fp32 weight [rows, cols] of its e4m3 `w` and its scales (`scale[e]` of the stack's)."""
    scales = scale.reshape(parts) if block is None else scale.chunk(parts, 0)
    return torch.cat([dequantize(q, s, block) for q, s in zip(w.chunk(parts, 0), scales, strict=True)])


def quantize_experts(w: Tensor, block: tuple[int, int] | None, parts: int) -> tuple[Tensor, Tensor]:
    """(e4m3 stack, scales) of a 16/32-bit stack [E, rows, cols]: each expert's segments quantized apart, as the
    checkpoints store them (the tests' and the benchmark's FP8 experts)."""
    qs, scales = [], []
    for e in range(w.shape[0]):
        pieces = [quantize_per_tensor(seg) if block is None else quantize_blockwise(seg, block)
                  for seg in w[e].chunk(parts, 0)]
        qs.append(torch.cat([q for q, _ in pieces]))
        scales.append(torch.stack([s for _, s in pieces]).reshape(-1) if block is None
                      else torch.cat([s for _, s in pieces]))
    scale = torch.stack(scales)
    return torch.stack(qs), scale.reshape(-1) if parts == 1 and block is None else scale


def dequantize_experts(w: Tensor, scale: Tensor, block: tuple[int, int] | None, parts: int) -> Tensor:
    """The whole fp32 stack [E, rows, cols] (`dequantize_expert` of each expert)."""
    return torch.stack([dequantize_expert(w[e], scale[e], block, parts) for e in range(w.shape[0])])


def check_moe_shapes(fn: str, x: Tensor, w_up: Tensor, w_down: Tensor, topk_ids: Tensor, topk_weights: Tensor,
                     activation: str, gated: bool, w_up_scale: Tensor | None = None,
                     w_down_scale: Tensor | None = None, block: tuple[int, int] | None = None) -> int:
    """Validate the experts' arguments (ValueError: expected vs got); returns the intermediate size I."""
    if x.dim() != 2:
        raise ValueError(f"{fn}: x expected 2 dims [T, d_in], got shape {tuple(x.shape)}")
    t, d_in = x.shape
    if w_up.dim() != 3 or w_up.shape[2] != d_in:
        raise ValueError(f"{fn}: w_up expected shape [E, (2)I, d_in={d_in}], got {tuple(w_up.shape)}")
    e = w_up.shape[0]
    if gated and w_up.shape[1] % 2:
        raise ValueError(f"{fn}: gated w_up expected an even row count [E, 2I, d_in], got {tuple(w_up.shape)}")
    inter = w_up.shape[1] // 2 if gated else w_up.shape[1]
    if w_down.dim() != 3 or w_down.shape[0] != e or w_down.shape[2] != inter:
        raise ValueError(f"{fn}: w_down expected shape [E={e}, d_out, I={inter}], got {tuple(w_down.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t:
        raise ValueError(f"{fn}: topk_ids expected shape [T={t}, top_k], got {tuple(topk_ids.shape)}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"{fn}: topk_weights expected shape {tuple(topk_ids.shape)}, got {tuple(topk_weights.shape)}")
    if activation not in ACTIVATIONS or (gated and activation != "silu"):
        raise ValueError(f"{fn}: activation expected one of {ACTIVATIONS} (gated: silu), got {activation!r}"
                         f" with gated={gated}")
    check_expert_scale(fn, "w_up", w_up, w_up_scale, block, 2 if gated else 1)
    check_expert_scale(fn, "w_down", w_down, w_down_scale, block, 1)
    if block is not None and w_up_scale is None and w_down_scale is None:
        raise ValueError(f"{fn}: block expected None without FP8 weights, got {block}")
    return inter


def align_reference(topk_ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor, Tensor]:
    """The sorted layout of the flattened (token, expert) rows r = token * top_k + slot (the kernel's contract):

    - sorted_ids [max_padded_rows] int32: expert 0's rows in increasing r, padded with the sentinel T * top_k to a
      multiple of block_m, then expert 1's, ...; the slots past the padded total hold the sentinel too;
    - expert_ids [cdiv(max_padded_rows, block_m)] int32: each block's expert, -1 past the padded total;
    - num_padded [1] int32: the padded total.
    Torch ops on static shapes, no host reads."""
    flat = topk_ids.reshape(-1).long()
    n, dev = flat.numel(), flat.device
    size = max_padded_rows(n, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    rank = torch.arange(n, device=dev) - (counts.cumsum(0) - counts)[expert_of]
    sorted_ids = torch.full((size,), n, dtype=torch.int32, device=dev)
    sorted_ids[(padded_end - padded)[expert_of] + rank] = order.int()
    block_start = torch.arange(0, size, block_m, device=dev)
    total = padded_end[-1:]
    expert_ids = torch.searchsorted(padded_end, block_start, right=True)
    expert_ids = torch.where(block_start < total, expert_ids, -1).int()
    return sorted_ids, expert_ids, total.int()


def _activate(h: Tensor, activation: str, gated: bool) -> Tensor:
    if gated:
        gate, up = h.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up
    if activation == "relu2":
        return relu2_reference(h)
    return {"relu": torch.relu, "silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu}[activation](h)


def _expert(w: Tensor, scale: Tensor | None, e: int, block: tuple[int, int] | None, parts: int,
            dtype: torch.dtype) -> Tensor:
    return w[e] if scale is None else dequantize_expert(w[e], scale[e], block, parts).to(dtype)


def moe_experts_reference(x: Tensor, w_up: Tensor, w_down: Tensor, topk_ids: Tensor, topk_weights: Tensor, *,
                          activation: str = "relu2", gated: bool = False, block_m: int = 16,
                          w_up_scale: Tensor | None = None, w_down_scale: Tensor | None = None,
                          block: tuple[int, int] | None = None) -> Tensor:
    """sum_j topk_weights[t, j] * down_e(act(up_e(x[t]))) for e = topk_ids[t, j]: [T, d_out] in x's dtype.

    x [T, d_in]; w_up [E, I, d_in] (gated: [E, 2I, d_in], gate rows then up rows); w_down [E, d_out, I];
    topk_ids [T, top_k] (ints in [0, E)); topk_weights [T, top_k] (any float dtype). FP8 stacks come with their
    `w_up_scale` / `w_down_scale` (per expert, or per `block`: module docstring); each expert run is dequantized."""
    check_moe_shapes("moe_experts_reference", x, w_up, w_down, topk_ids, topk_weights, activation, gated,
                     w_up_scale, w_down_scale, block)
    t, top_k = topk_ids.shape
    num_experts = w_up.shape[0]
    n = t * top_k
    rows = torch.zeros(n, w_down.shape[1], dtype=x.dtype, device=x.device)  # one per (token, slot), as the kernel's
    if n:
        sorted_ids, _, _ = align_reference(topk_ids, num_experts, block_m)
        counts = torch.bincount(topk_ids.reshape(-1).long(), minlength=num_experts).tolist()  # the host sync
        weights = topk_weights.reshape(-1).float()
        start = 0
        for e, c in enumerate(counts):
            if c:
                r = sorted_ids[start:start + c].long()  # this expert's rows, in increasing r
                up = _expert(w_up, w_up_scale, e, block, 2 if gated else 1, x.dtype)
                h = _activate(torch.nn.functional.linear(x[r // top_k], up), activation, gated)
                y = torch.nn.functional.linear(h, _expert(w_down, w_down_scale, e, block, 1, x.dtype))
                rows[r] = (y.float() * weights[r, None]).to(x.dtype)
            start += (c + block_m - 1) // block_m * block_m
    return rows.view(t, top_k, -1).sum(1, dtype=torch.float32).to(x.dtype)
