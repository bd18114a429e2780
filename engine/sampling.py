"""Next-token sampling over a batch of rows, each with its own `SamplingParams` and generator.

Order of operations (as in HF's logits warpers and vLLM): temperature, then top-k, then top-p on the
top-k-renormalised distribution, then one draw. Greedy rows (temperature 0) take the argmax.

Reproducibility: a seeded row must give the same tokens whatever batch it is in. Everything but the
random draw is row-wise math; the draw uses the exponential race (argmax of p_i / q_i with
q_i ~ Exp(1), which picks i with probability p_i) where each row's noise comes only from its own
generator. Rows without a generator share one draw from the global RNG.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .host_copy import to_device
from .sampling_params import SamplingParams


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    """A generator on `device`; seed None draws a fresh nondeterministic seed, so every request owns one."""
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


class Sampler:
    """Stateless: all per-request state lives in the params and generators passed to `sample`."""

    def sample(self, logits: Tensor, params: Sequence[SamplingParams],
               generators: Sequence[torch.Generator | None]) -> Tensor:
        """logits [R, V] -> token ids [R] int64 on logits.device."""
        if logits.dim() != 2:
            raise ValueError(f"logits: expected shape [R, V], got {tuple(logits.shape)}")
        R, V = logits.shape
        if len(params) != R or len(generators) != R:
            raise ValueError(f"expected one SamplingParams and one generator per row ({R} rows), "
                             f"got {len(params)} params and {len(generators)} generators")
        # argmax returns the first maximum, so ties go to the lowest id on every device; 16-bit logits give the
        # argmax of their float32 copy (the same values), so only the rows that draw are upcast.
        out = logits.argmax(dim=-1)  # [R]
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            idx = to_device(rows, torch.int64, logits.device)
            probs = self._probs(logits[idx].float(), [params[i] for i in rows])  # [r, V]
            out[idx] = self._draw(probs, [generators[i] for i in rows])
        return out

    @staticmethod
    def _probs(logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
        """logits [r, V] -> filtered, renormalised probabilities [r, V]."""
        dev = logits.device
        temp = to_device([p.temperature for p in params], torch.float32, dev)  # [r]
        # Subtract the row max before dividing: softmax is shift-invariant, and this keeps a tiny
        # temperature from turning the top logit into inf (inf - inf = NaN in softmax).
        scaled = (logits - logits.amax(dim=-1, keepdim=True)) / temp[:, None]  # [r, V]
        if all(p.top_k == 0 and p.top_p >= 1.0 for p in params):
            return scaled.softmax(dim=-1)
        k = to_device([p.top_k for p in params], torch.int64, dev)  # [r]
        top_p = to_device([p.top_p for p in params], torch.float32, dev)  # [r]
        return _filter(scaled, k, top_p)

    @staticmethod
    def _draw(probs: Tensor, generators: Sequence[torch.Generator | None]) -> Tensor:
        """probs [r, V] -> one token id per row [r], by the exponential race."""
        q = torch.empty_like(probs)  # [r, V]
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if unseeded:
            q[to_device(unseeded, torch.int64, probs.device)] = torch.empty(
                len(unseeded), probs.shape[1], device=probs.device).exponential_()
        for i, g in enumerate(generators):
            if g is not None:
                if g.device.type != probs.device.type:
                    raise ValueError(f"generator of row {i}: expected one on {probs.device.type}, "
                                     f"got one on {g.device}")
                q[i].exponential_(generator=g)
        # Exp(1) can round to 0; 0 / 0 = NaN would win argmax. Clamped, a filtered token (p = 0) scores 0
        # and loses to any kept one (p > 0), and p / tiny stays finite for p <= 1.
        q.clamp_min_(torch.finfo(q.dtype).tiny)
        return (probs / q).argmax(dim=-1)


def filtered_probs(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """`Sampler._probs` of rows with filters from device tensors alone (no host list: what a CUDA graph holds):
    logits [r, V] float32, temperature [r] float32 (> 0), top_k [r] int64 (0: none), top_p [r] float32 ->
    the filtered, renormalised probabilities [r, V]."""
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / temperature[:, None]  # [r, V]
    return _filter(scaled, top_k, top_p)


def _filter(scaled: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Top-k (0: none), then top-p on the top-k-renormalised distribution: scaled logits [r, V] -> [r, V]."""
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
    filtered = torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_logits)
    return filtered.softmax(dim=-1)
