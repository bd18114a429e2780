"""The distribution a row samples its next token from, and its noise seed.

Order of operations (vLLM's): on the raw logits, logit_bias and min_tokens (the stop ids masked until min_tokens
outputs), then the repetition, frequency and presence penalties (`logits_processing`); then temperature, min_p
(tokens with p >= min_p * p_max; written as a mask on the raw logits, `logits_processing`), top-k, and top-p on the
distribution those leave. Greedy rows (temperature 0) take the argmax of the processed logits instead.

The draw itself is the rejection sampler's (`RejectionSampler.sample`: a row without drafts), by inverse CDF with
noise that is a function of the request's seed and the position of the token drawn (`counter_noise`). So a seeded
request gets the same tokens whatever batch, step, engine or node samples them, and every engine, with or without
drafts, draws alike. Everything else is row-wise math.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import torch
from torch import Tensor

from .host_copy import to_device
from .sampling_params import SamplingParams


def request_seed(seed: int | None) -> int:
    """A request's noise seed (`counter_noise`): its SamplingParams.seed, or fresh entropy when None, so that every
    request owns one."""
    return secrets.randbits(63) if seed is None else seed


def probs(logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """logits [r, V] float32 of rows that sample -> their filtered, renormalised probabilities [r, V]."""
    dev = logits.device
    temp = to_device([p.temperature for p in params], torch.float32, dev)  # [r]
    # Subtract the row max before dividing: softmax is shift-invariant, and this keeps a tiny
    # temperature from turning the top logit into inf (inf - inf = NaN in softmax).
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / temp[:, None]  # [r, V]
    if all(p.top_k == 0 and p.top_p >= 1.0 for p in params):
        return scaled.softmax(dim=-1)
    k = to_device([p.top_k for p in params], torch.int64, dev)  # [r]
    top_p = to_device([p.top_p for p in params], torch.float32, dev)  # [r]
    return _filter(scaled, k, top_p).softmax(dim=-1)


def filtered_logits(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """The filtered distribution of rows with filters as logits, from device tensors alone (no host list: what a
    CUDA graph holds): logits [r, V] float32, temperature [r] float32 (> 0), top_k [r] int64 (0: none), top_p [r]
    float32 -> [r, V] float32, the scaled logits (row max 0) with -inf outside the filter; their softmax is `probs`."""
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / temperature[:, None]  # [r, V]
    return _filter(scaled, top_k, top_p)


def _filter(scaled: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Top-k (0: none), then top-p on the top-k-renormalised distribution: scaled logits [r, V] -> the kept ones,
    -inf elsewhere [r, V]."""
    V = scaled.shape[1]
    # A stable descending sort orders equal logits by id, so which of several tied tokens survives
    # a top-k cut is deterministic.
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)  # [r, V]
    pos = torch.arange(V, device=scaled.device)  # [V]
    k = torch.where(top_k > 0, top_k, V)  # [r]
    sorted_logits = sorted_logits.masked_fill(pos[None, :] >= k[:, None], float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)  # [r, V], the top-k-renormalised distribution
    # Mass strictly before each token: a token stays while that mass is < top_p, which keeps the
    # smallest prefix reaching top_p and always the first token. Rows with top_p = 1 skip the cut,
    # since rounding can push the cumsum to 1 before the tail and drop tokens that should stay.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    cut = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
    # Scatter back to vocabulary order, so a seed's noise maps to token ids and not to ranks.
    return torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_logits)
