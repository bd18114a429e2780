"""The torch reference of speculative verification's decisions (`kernel.py` is its kernel; the
rejection sampler, `engine/rejection_sampler.py`, says what is decided and why): greedy rows by the argmax,
stochastic rows by speculative sampling, rows at a temperature alone (`tempered_decisions`) and with top-k / top-p
(`filtered_decisions`); every draw from counter-based noise of the row's seed and position."""

from __future__ import annotations

import torch
from torch import Tensor

from baton.engine.counter_noise import ACCEPT, DRAW, uniform
from baton.engine.ops.tempered_verify.tuning import FILTER_ROWS
from baton.engine.sampling import filtered_logits


def _draw(dist: Tensor, u: Tensor) -> Tensor:
    """dist [r, V] >= 0, not all zero in a row (unnormalised), u [r] in [0, 1) -> [r]: the first id whose
    cumulative mass exceeds u * total, i.e. id i with probability dist_i / total; never an id of mass 0."""
    c = dist.cumsum(dim=-1)  # [r, V]
    i = torch.searchsorted(c, (u * c[:, -1])[:, None], right=True).squeeze(1)  # [r]
    # Rounding can put u * total at the total: clamp to the last id with mass.
    ids = torch.arange(dist.shape[1], device=dist.device)
    last = torch.where(dist > 0, ids, 0).amax(dim=-1)  # [r]
    return torch.minimum(i, last)


def _prefix_len(accept: Tensor) -> Tensor:
    """accept [R, K] bool -> length of the all-True prefix of each row [R] int64 (0 when K = 0)."""
    return accept.long().cumprod(dim=1).sum(dim=1)


def greedy_decisions(logits: Tensor, draft_token_ids: Tensor, num_draft: Tensor
            ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> (drafts [R, Kmax] with padding zeroed, num_draft [R] int64 on the logits' device, valid [R, Kmax], and
    every row's greedy decision: accepted [R], final [R])."""
    R, K1, _ = logits.shape
    Kmax, dev = K1 - 1, logits.device
    nd = num_draft.to(device=dev, dtype=torch.int64, non_blocking=True)  # [R]
    valid = torch.arange(Kmax, device=dev)[None, :] < nd[:, None]  # [R, Kmax]
    # Padding ids may be -1 or garbage; zero them so gathers stay in range (they are never accepted).
    drafts = torch.where(valid, draft_token_ids.to(dev, torch.int64), 0)  # [R, Kmax]
    argmax = logits.argmax(dim=-1)  # [R, Kmax+1]; the first maximum, so ties go to the lowest id
    accepted = _prefix_len((drafts == argmax[:, :Kmax]) & valid)  # [R]
    final = argmax.gather(1, accepted[:, None]).squeeze(1)  # [R], mismatch or bonus position
    return drafts, nd, valid, accepted, final


def _accept(p_x: Tensor, valid: Tensor, seeds: Tensor, positions: Tensor) -> Tensor:
    """The accept tests: p_x [r, Kmax] (p(x) / q(x) of each draft; p(x) for a one-hot q), valid [r, Kmax],
    seeds / positions [r] -> accepted [r], the length of the accepted prefix."""
    cols = torch.arange(p_x.shape[1], device=p_x.device)[None, :]  # [1, Kmax]
    u = uniform(seeds[:, None], positions[:, None] + cols, ACCEPT)  # [r, Kmax]
    # u in [0, 1), so a ratio >= 1 always accepts: q == p accepts every draft, as it should.
    return _prefix_len((u < p_x) & valid)  # [r]


def _final(p_at: Tensor, q_at: Tensor | None, accepted: Tensor, valid: Tensor, seeds: Tensor, positions: Tensor
           ) -> Tensor:
    """The token after the accepted drafts: p_at [r, V], p at the first rejected position or at the bonus
    position when all were accepted; q_at [r, V] the draft distribution there (None when Kmax = 0) -> [r]."""
    dist = p_at
    if q_at is not None:
        resid = (p_at - q_at).clamp_min(0)  # unnormalised: the draw below scales by the total
        # In exact arithmetic a rejection implies some p > q; rounding can still reject with an empty
        # residual, which has nothing to draw from. Fall back to p.
        resid = torch.where(resid.sum(dim=-1, keepdim=True) > 0, resid, p_at)
        rejected = accepted < valid.sum(dim=1)  # [r]
        dist = torch.where(rejected[:, None], resid, p_at)
    return _draw(dist, uniform(seeds, positions + accepted, DRAW))


def _one_hot_at(drafts: Tensor, accepted: Tensor, like: Tensor) -> Tensor | None:
    """The one-hot q of deterministic drafts at each row's decided position [r, V] (None when Kmax = 0);
    all-accepted rows are clamped to their last draft and masked by `_final`."""
    if drafts.shape[1] == 0:
        return None
    k = accepted.clamp(max=drafts.shape[1] - 1)[:, None]  # [r, 1]
    return torch.zeros_like(like).scatter_(1, drafts.gather(1, k), 1.0)


def stochastic_decisions(p: Tensor, drafts: Tensor, valid: Tensor, q: Tensor | None, seeds: Tensor, positions: Tensor
                ) -> tuple[Tensor, Tensor]:
    """p [r, Kmax+1, V] (the target's filtered distribution at each position), drafts/valid [r, Kmax],
    q [r, Kmax, V] | None, seeds/positions [r] -> speculative sampling's (accepted [r], final [r])."""
    r, K1, V = p.shape
    Kmax = K1 - 1
    p_x = p[:, :Kmax].gather(-1, drafts[..., None]).squeeze(-1)  # [r, Kmax]
    if q is not None:
        q = q.float()
        # q(x) = 0 gives inf (accept) or 0/0 = NaN (reject: NaN compares False); both are the limit.
        p_x = p_x / q.gather(-1, drafts[..., None]).squeeze(-1)  # [r, Kmax]
    accepted = _accept(p_x, valid, seeds, positions)
    p_at = p.gather(1, accepted[:, None, None].expand(r, 1, V)).squeeze(1)  # [r, V]
    if q is None:
        q_at = _one_hot_at(drafts, accepted, p_at)
    else:
        q_at = None if Kmax == 0 else q.gather(
            1, accepted.clamp(max=Kmax - 1)[:, None, None].expand(r, 1, V)).squeeze(1)
    return accepted, _final(p_at, q_at, accepted, valid, seeds, positions)




def _filtered_rows(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, each) -> None:
    """Call each(start, end, z) for consecutive row ranges of logits [n, V] with their filtered distributions as
    logits (`sampling.filtered_logits`, FILTER_ROWS rows at a time)."""
    for s in range(0, logits.shape[0], FILTER_ROWS):
        e = min(s + FILTER_ROWS, logits.shape[0])
        each(s, e, filtered_logits(logits[s:e].float(), temperature[s:e], top_k[s:e], top_p[s:e]))


def _draw_filtered(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, seeds: Tensor,
                   positions: Tensor, exclude: Tensor | None = None) -> Tensor:
    """A draw from each row's filtered distribution: logits [r, V], temperature [r] float32 (0: a row to skip,
    its result undefined), top_k / top_p / seeds [r], positions [r] (of the token drawn), exclude [r] | None (a
    token to remove from the distribution first, where not -1: a rejected draft) -> [r] int64.

    The filtered logits go through `tempered_decisions` at temperature 1 with no drafts (its inverse-CDF draw
    and counter noise); the filter's [r, V] copies are made FILTER_ROWS rows at a time."""
    r = logits.shape[0]
    temp = torch.where(temperature > 0, temperature, 1.0)
    if r <= FILTER_ROWS:
        z = filtered_logits(logits.float(), temp, top_k, top_p)
    else:
        z = logits.new_empty(logits.shape, dtype=torch.float32)
        _filtered_rows(logits, temp, top_k, top_p, lambda s, e, f: z[s:e].copy_(f))
    if exclude is not None:
        # Removing the rejected draft leaves mass: it had all of it only at p = 1, which every accept test passes.
        d = exclude.clamp_min(0)[:, None]
        z.scatter_(1, d, torch.where(exclude[:, None] >= 0, float("-inf"), z.gather(1, d)))
    none = seeds.new_zeros(r, 0)
    return tempered_decisions(z[:, None], none, seeds.new_zeros(r), (temperature > 0).float(), seeds, positions)[1]


def filtered_decisions(logits: Tensor, drafts: Tensor, num_draft: Tensor, temperature: Tensor, top_k: Tensor,
                       top_p: Tensor, seeds: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    """Speculative sampling of deterministic drafts under temperature, top-k and top-p (`verify`'s math for
    such rows, from device tensors alone: what a CUDA graph holds), FILTER_ROWS distributions at a time so that
    the sort's memory does not grow with the batch: logits [R, K+1, V], drafts [R, K] int64 (padding in range),
    num_draft / top_k (0: none) / seeds / positions [R] int64, temperature / top_p [R] float32 -> (accepted [R],
    final [R]), defined on the rows whose temperature is above 0. The final token is `_draw_filtered`'s.

    The torch reference of `ops.tempered_verify.kernel.filtered_decisions_triton`, which finds each filter's cut
    by a search instead of sorting."""
    R, K1, V = logits.shape
    K = K1 - 1
    if K == 0:
        accepted = seeds.new_zeros(R)
        return accepted, _draw_filtered(logits[:, 0], temperature, top_k, top_p, seeds, positions)
    valid = torch.arange(K, device=drafts.device)[None, :] < num_draft[:, None]
    temp = torch.where(temperature > 0, temperature, 1.0)
    # The accept tests: p at each draft, the distributions of every position but the last.
    flat = logits[:, :K].reshape(R * K, V)
    ids = drafts.reshape(R * K, 1)
    p_x = logits.new_empty(R * K, dtype=torch.float32)
    rep = lambda t: t.repeat_interleave(K)  # noqa: E731 (a row's parameters at each of its positions)

    def gather(s: int, e: int, z: Tensor) -> None:
        p_x[s:e] = (z.gather(1, ids[s:e]) - z.logsumexp(dim=1, keepdim=True)).exp().squeeze(1)

    _filtered_rows(flat, rep(temp), rep(top_k), rep(top_p), gather)
    accepted = _accept(p_x.view(R, K), valid, seeds, positions)
    # The draw at each row's decided position: the residual after a rejected draft (p without it), else p.
    at = logits[torch.arange(R, device=logits.device), accepted]  # [R, V]
    rejected = drafts.gather(1, accepted.clamp(max=K - 1)[:, None]).squeeze(1)
    exclude = torch.where(accepted < num_draft, rejected, -1)
    return accepted, _draw_filtered(at, temperature, top_k, top_p, seeds, positions + accepted, exclude)


def tempered_decisions(logits: Tensor, drafts: Tensor, num_draft: Tensor, temperature: Tensor, seeds: Tensor,
                       positions: Tensor) -> tuple[Tensor, Tensor]:
    """Speculative sampling of deterministic drafts at a temperature with no top-k / top-p filter (the torch
    reference of `ops.tempered_verify.kernel`): logits [R, K+1, V], drafts [R, K] int64 (padding in range),
    num_draft / seeds / positions [R] int64, temperature [R] float32 -> (accepted [R], final [R]), defined on the
    rows whose temperature is above 0."""
    valid = torch.arange(drafts.shape[1], device=drafts.device)[None, :] < num_draft[:, None]
    x = logits.float()
    # As sampling.probs: the row max subtracted before dividing (a tiny temperature gives no inf - inf).
    scaled = (x - x.amax(dim=-1, keepdim=True)) / torch.where(temperature > 0, temperature, 1.0)[:, None, None]
    return stochastic_decisions(scaled.softmax(dim=-1), drafts, valid, None, seeds, positions)
