"""Speculative-decoding verification: which draft tokens a batch of requests keeps, and the token after them.

Each row r has K_r draft tokens x_0..x_{K_r-1} (padded to Kmax) and the target's logits at K_r + 1 positions:
position k scores the token after x_{k-1}, position K_r is the bonus position after the last draft.

- Greedy rows (temperature 0) accept x_k while it equals the target's argmax at k; the emitted tokens are the
  accepted drafts plus the argmax at the first mismatch (or at the bonus position), exactly what
  non-speculative greedy decoding emits.
- Stochastic rows use speculative sampling (Leviathan et al. 2023, Chen et al. 2023): accept x_k with
  probability min(1, p_k(x_k) / q_k(x_k)); at the first rejection emit a draw from norm(max(0, p_k - q_k));
  when all K_r are accepted emit a draw from p_{K_r}. Each emitted token is then distributed as a plain draw
  from p. p is the target distribution after temperature / top-k / top-p (`sampling.probs`, so the filtering
  is the non-speculative sampler's); q is the distribution each draft was actually drawn from, passed as
  `draft_probs` (already filtered, as the drafter sampled it). `draft_probs=None` means deterministic drafts
  (e.g. the MTP drafter's argmax), i.e. q is one-hot on x_k: accept with probability p_k(x_k), and on
  rejection draw from p_k with x_k removed.

Device-authoritative counts (DESIGN R3): `accepted_counts` is computed on the logits' device with no host
sync, so the verify step can pick the state slot to resume from without a round trip. Every row is decided by
the same vectorised ops: no per-row loop and no generator.

The decisions' torch reference is `ops.tempered_verify.reference`. Rows that sample at a temperature alone (no top-k /
top-p, deterministic drafts) are decided by `tempered_decisions`, on the GPU by one Triton launch (`ops.tempered_verify.kernel`) that makes none of the
[R, Kmax+1, V] float32 copies of the torch path; `verify` and `verify_tempered` (a CUDA graph's) both decide them so.
Rows with top-k / top-p are decided by `filtered_decisions` (the sampler's sort-based filter); on the GPU by the same
kernel, which finds each filter's cut by a search (three keys tested per pass over V) instead of sorting.

Reproducibility: a stochastic row's noise is a function of its seed and of the position of the token it decides
(`counter_noise`): the accept test of the draft at position t and the draw of the token emitted at t. So a seeded
row verifies the same way whatever batch it is in and whatever the batch's Kmax (its own drafts decide which tests
it makes). A draw is by inverse CDF (one uniform against the cumulative distribution), so it costs one uniform
per row, not one per vocabulary entry.

Tensor parallelism (R3 across ranks): every rank holds the same gathered logits, but the decisions are rank 0's,
broadcast (`_agree`), so that every rank emits, accepts and resumes from the same tokens whatever its kernels did.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .host_copy import to_device
from .logits_processing import LogitsInputs
from .ops.kernels import Kernels
from .ops.tempered_verify.reference import greedy_decisions, stochastic_decisions
from .parallel.group import TPGroup
from .sample_inputs import SampleInputs, is_filtered, is_tempered, sample_inputs
from .sampling import probs
from .sampling_params import SamplingParams


@dataclass(frozen=True)
class VerifyResult:
    """All on the target logits' device, int64."""

    output_token_ids: Tensor  # [R, Kmax+1]: accepted drafts, then one sampled token, then -1 padding
    accepted_counts: Tensor  # [R]: accepted draft tokens, 0..K_r
    num_emitted: Tensor  # [R]: accepted_counts + 1


def _result(drafts: Tensor, accepted: Tensor, final: Tensor) -> VerifyResult:
    R, Kmax = drafts.shape
    j = torch.arange(Kmax + 1, device=drafts.device)[None, :]  # [1, Kmax+1]
    padded = torch.cat([drafts, drafts.new_zeros(R, 1)], dim=1)  # [R, Kmax+1]
    out = torch.where(j < accepted[:, None], padded, -1)
    out = torch.where(j == accepted[:, None], final[:, None], out)  # [R, Kmax+1]
    return VerifyResult(output_token_ids=out, accepted_counts=accepted, num_emitted=accepted + 1)


class RejectionSampler:
    """Stateless apart from `max_draft` and `kernels`; per-request state lives in the params and seeds passed in."""

    def __init__(self, max_draft: int, kernels: Kernels, tp: TPGroup | None = None) -> None:
        # The widest batch accepted (the engine's --speculative-tokens).
        if not isinstance(max_draft, int) or isinstance(max_draft, bool) or max_draft < 0:
            raise ValueError(f"max_draft: expected an integer >= 0, got {max_draft!r}")
        self.max_draft = max_draft
        # The engine's implementation of the tempered / filtered decisions (`ops.kernels`).
        self.kernels = kernels
        # The tensor-parallel group whose rank 0 decides for all (None: this process alone).
        self.tp = tp

    def _agree(self, decided: Tensor) -> Tensor:
        """Rank 0's `decided`, on every rank (itself where there is no group)."""
        return decided if self.tp is None else self.tp.broadcast(decided)

    def _agreed_result(self, drafts: Tensor, accepted: Tensor, final: Tensor) -> VerifyResult:
        return _result(drafts, self._agree(accepted), self._agree(final))

    def verify(self, target_logits: Tensor, draft_token_ids: Tensor, draft_probs: Tensor | None,
               num_draft: Tensor, params: Sequence[SamplingParams], seeds: Tensor | None = None,
               positions: Tensor | None = None, processing: LogitsInputs | None = None) -> VerifyResult:
        """target_logits [R, Kmax+1, V], draft_token_ids [R, Kmax] (padding: any value, e.g. -1),
        draft_probs [R, Kmax, V] or None, num_draft [R] (K_r <= Kmax; on the host or the device). With any
        stochastic row: seeds [R] int64 (`sampling.request_seed`) and positions [R] int64, the position of the
        token that column 0 decides (a row's last token's position + 1), both on the logits' device.

        num_draft values are range-checked only when it is a CPU tensor (checking a device tensor would sync).
        `processing` (`logits_processing`): the rows' penalties, logit_bias, min_tokens and min_p, applied to
        every position's logits first, so that greedy rows take the processed argmax and p is the processed
        distribution (a draft is counted as generated at the positions after it).
        """
        R, K1, V = self._check(target_logits, draft_token_ids, draft_probs, num_draft, params, seeds, positions)
        if processing is not None:
            target_logits = self.kernels.process_logits(target_logits, draft_token_ids, num_draft, processing)
        # The argmax needs no float32 copy (16-bit logits give their float32 copy's); stochastic rows upcast below.
        drafts, nd, valid, accepted, final = greedy_decisions(target_logits, draft_token_ids, num_draft)
        tempered = draft_probs is None and any(is_tempered(p) for p in params)
        if tempered:  # as verify_tempered decides them, so a row gets the same tokens in a graph or not
            assert seeds is not None and positions is not None  # _check
            temp = to_device([p.temperature if is_tempered(p) else 0.0 for p in params], torch.float32,
                             target_logits.device)
            accepted, final = self._tempered(target_logits, drafts, nd, temp, seeds, positions, accepted, final)
        rows = [i for i, p in enumerate(params) if not p.greedy and not (tempered and is_tempered(p))]
        if rows:
            dev = target_logits.device
            idx = to_device(rows, torch.int64, dev)
            assert seeds is not None and positions is not None  # _check
            if draft_probs is None:  # top-k / top-p rows: as verify_tempered's filtered rows
                sub = [params[i] for i in rows]
                temp = to_device([p.temperature for p in sub], torch.float32, dev)
                top_k = to_device([p.top_k for p in sub], torch.int64, dev)
                top_p = to_device([p.top_p for p in sub], torch.float32, dev)
                acc_s, final_s = self.kernels.filtered_decisions(
                    target_logits[idx], drafts[idx], nd[idx], temp, top_k, top_p, seeds[idx], positions[idx])
            else:
                # Every position of a row uses that row's params: flatten positions into rows for probs.
                r = len(rows)
                p = probs(target_logits[idx].float().reshape(r * K1, V), [params[i] for i in rows for _ in range(K1)])
                acc_s, final_s = stochastic_decisions(p.view(r, K1, V), drafts[idx], valid[idx], draft_probs[idx],
                                             seeds[idx], positions[idx])
            accepted[idx] = acc_s
            final[idx] = final_s
        return self._agreed_result(drafts, accepted, final)

    def sample(self, logits: Tensor, params: Sequence[SamplingParams], seeds: Tensor | None,
               positions: Tensor | None, processing: LogitsInputs | None = None) -> Tensor:
        """The next token of rows without drafts: logits [R, V] -> [R] int64 on their device, the argmax of
        greedy rows, the others drawn from their filtered distribution as `verify` draws a row's bonus token
        (seeds / positions as there: the position of the token drawn; None when every row is greedy)."""
        n = logits.shape[0]
        if len(params) != n:
            raise ValueError(f"params: expected one SamplingParams per row ({n} rows), got {len(params)}")
        if processing is not None:
            logits = self.processed(logits, processing)
        if seeds is None and all(p.greedy for p in params):
            return self._agree(logits.argmax(dim=-1))
        if seeds is None or positions is None:  # (the checks' error for the missing one)
            zeros = torch.zeros(n, dtype=torch.int64, device=logits.device)
            self._check(logits[:, None], zeros[:, None][:, :0], None, zeros, params, seeds, positions)
        return self.decide(logits, params, sample_inputs(params, seeds, positions, logits.device))

    def processed(self, logits: Tensor, processing: LogitsInputs) -> Tensor:
        """Rows without drafts: logits [R, V] -> their processed logits [R, V] in the logits' dtype
        (`logits_processing`)."""
        none = torch.zeros(logits.shape[0], 0, dtype=torch.int64, device=logits.device)
        return self.kernels.process_logits(logits[:, None], none, none.new_zeros(logits.shape[0]), processing)[:, 0]

    def decide(self, logits: Tensor, params: Sequence[SamplingParams], inputs: SampleInputs,
               processing: LogitsInputs | None = None) -> Tensor:
        """`sample` from the rows' inputs already on the device (`sample_inputs`: a runner builds them before the
        step's forward, in one copy). What `verify` decides for these rows without its accept-test bookkeeping
        (fewer launches on every sampling step): the argmax, `tempered_decisions`' draw, or
        `filtered_decisions`'. `processing`: as in `sample`."""
        if processing is not None:
            logits = self.processed(logits, processing)
        none = inputs.no_drafts[:, None][:, :0]
        self._check(logits[:, None], none, None, inputs.no_drafts, params, inputs.seeds, inputs.positions)
        final = logits.argmax(dim=-1) if any(p.greedy for p in params) else None
        for kind, op, temp, extra in (
                (is_tempered, self.kernels.tempered_decisions, inputs.temperature, ()),
                (is_filtered, self.kernels.filtered_decisions, inputs.temperature_f, (inputs.top_k, inputs.top_p))):
            if any(kind(p) for p in params):
                drawn = op(logits[:, None], none, inputs.no_drafts, temp, *extra, inputs.seeds, inputs.positions)[1]
                final = drawn if final is None else torch.where(temp > 0, drawn, final)
        assert final is not None  # (every row is greedy, tempered or filtered)
        return self._agree(final)

    def verify_tempered(self, target_logits: Tensor, draft_token_ids: Tensor, num_draft: Tensor,
                        temperature: Tensor, seeds: Tensor, positions: Tensor, top_k: Tensor | None = None,
                        top_p: Tensor | None = None) -> VerifyResult:
        """`verify` of deterministic drafts (q one-hot) from device tensors alone, with no host read or host
        list (what a CUDA graph holds): temperature [R] float32 (0: a greedy row), seeds / positions [R] int64 as
        in `verify`, and optionally top_k [R] int64 (0: none) / top_p [R] float32. Rows at a temperature with no
        filter are decided by `tempered_decisions` (one Triton launch on the GPU), those with one by
        `filtered_decisions`, each as `verify` decides such `SamplingParams`."""
        R = target_logits.shape[0]
        self._check(target_logits, draft_token_ids, None, num_draft, [SamplingParams()] * R, None, None)
        filters = (("top_k", top_k, torch.int64), ("top_p", top_p, torch.float32)) if top_k is not None else ()
        if (top_k is None) != (top_p is None):
            raise ValueError(f"top_k, top_p: expected both or neither, got {top_k} and {top_p}")
        for name, t, dtype in (("temperature", temperature, torch.float32), ("seeds", seeds, torch.int64),
                               ("positions", positions, torch.int64), *filters):
            if tuple(t.shape) != (R,) or t.dtype != dtype or t.device != target_logits.device:
                raise ValueError(f"{name}: expected a {dtype} tensor of shape [R] = {(R,)} on "
                                 f"{target_logits.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
        drafts, nd, _, accepted, final = greedy_decisions(target_logits, draft_token_ids, num_draft)
        if top_k is None:
            return self._agreed_result(drafts, *self._tempered(target_logits, drafts, nd, temperature, seeds,
                                                               positions, accepted, final))
        assert top_p is not None
        filtered = (temperature > 0) & ((top_k > 0) | (top_p < 1.0))
        accepted, final = self._tempered(target_logits, drafts, nd, torch.where(filtered, 0.0, temperature), seeds,
                                         positions, accepted, final)
        acc_f, final_f = self.kernels.filtered_decisions(
            target_logits, drafts, nd, torch.where(filtered, temperature, 0.0), top_k, top_p, seeds, positions)
        return self._agreed_result(drafts, torch.where(filtered, acc_f, accepted),
                                   torch.where(filtered, final_f, final))

    def _tempered(self, logits: Tensor, drafts: Tensor, nd: Tensor, temperature: Tensor, seeds: Tensor,
                  positions: Tensor, accepted: Tensor, final: Tensor) -> tuple[Tensor, Tensor]:
        """The greedy decisions (accepted, final) with the rows whose temperature is above 0 decided by
        `tempered_decisions` (the Triton kernel on the GPU)."""
        acc_s, final_s = self.kernels.tempered_decisions(logits, drafts, nd, temperature, seeds, positions)
        sampled = temperature > 0
        return torch.where(sampled, acc_s, accepted), torch.where(sampled, final_s, final)

    def _check(self, target_logits: Tensor, draft_token_ids: Tensor, draft_probs: Tensor | None,
               num_draft: Tensor, params: Sequence[SamplingParams], seeds: Tensor | None,
               positions: Tensor | None) -> tuple[int, int, int]:
        """Shape, dtype and length checks (host metadata only, no sync) -> (R, Kmax+1, V)."""
        if target_logits.dim() != 3 or target_logits.shape[1] < 1 or target_logits.shape[2] < 1:
            raise ValueError(f"target_logits: expected shape [R, Kmax+1, V] with Kmax+1 >= 1 and V >= 1, "
                             f"got {tuple(target_logits.shape)}")
        R, K1, V = target_logits.shape
        if tuple(draft_token_ids.shape) != (R, K1 - 1):
            raise ValueError(f"draft_token_ids: expected shape [R, Kmax] = {(R, K1 - 1)}, "
                             f"got {tuple(draft_token_ids.shape)}")
        if draft_token_ids.dtype.is_floating_point or draft_token_ids.dtype == torch.bool:
            raise ValueError(f"draft_token_ids: expected an integer dtype, got {draft_token_ids.dtype}")
        if self.max_draft < K1 - 1:
            raise ValueError(f"draft_token_ids: expected at most max_draft={self.max_draft} columns, "
                             f"got {K1 - 1}")
        if draft_probs is not None and tuple(draft_probs.shape) != (R, K1 - 1, V):
            raise ValueError(f"draft_probs: expected shape [R, Kmax, V] = {(R, K1 - 1, V)}, "
                             f"got {tuple(draft_probs.shape)}")
        if tuple(num_draft.shape) != (R,):
            raise ValueError(f"num_draft: expected shape [R] = {(R,)}, got {tuple(num_draft.shape)}")
        if num_draft.dtype.is_floating_point or num_draft.dtype == torch.bool:
            raise ValueError(f"num_draft: expected an integer dtype, got {num_draft.dtype}")
        if num_draft.device.type == "cpu" and R > 0:
            lo, hi = int(num_draft.min()), int(num_draft.max())
            if lo < 0 or hi > K1 - 1:
                raise ValueError(f"num_draft: expected values in [0, Kmax={K1 - 1}], got range [{lo}, {hi}]")
        if len(params) != R:
            raise ValueError(f"params: expected one SamplingParams per row ({R} rows), got {len(params)}")
        if any(not p.greedy for p in params):
            for name, t in (("seeds", seeds), ("positions", positions)):
                if t is None:
                    raise ValueError(f"{name}: expected an int64 tensor of shape [R] = {(R,)} for the stochastic "
                                     f"rows, got None")
                if tuple(t.shape) != (R,) or t.dtype != torch.int64 or t.device != target_logits.device:
                    raise ValueError(f"{name}: expected an int64 tensor of shape [R] = {(R,)} on "
                                     f"{target_logits.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
        return R, K1, V
