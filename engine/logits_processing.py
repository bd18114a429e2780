"""Logits processing before the draw: logit_bias, min_tokens, the presence / frequency / repetition penalties and
min_p, applied to the raw logits of every position a row decides (a verify row's K+1 positions, or one).

Order (vLLM's): a grammar's token mask (`grammar`: disallowed tokens become -inf first, so that min_p's p_max is
the best allowed token's), logit_bias and min_tokens, then the penalties (repetition, frequency, presence), all on the raw
logits; then min_p, which depends on the temperature and is written as a mask on the raw logits (p >= min_p *
p_max after temperature t is x >= x_max + t * log(min_p)), so that the draw's temperature, top-k and top-p
(`sampling`) follow it unchanged: min_p, then top-k, then top-p on what is left, as vLLM filters. Greedy rows
take the argmax of the processed logits and ignore min_p.

The counts a penalty reads are of the tokens the request generated before the token decided, and position j of a
verify row adds drafts 0..j-1, which are generated tokens exactly when position j is decided. So a verify row's
position j is processed as a plain step after those drafts would be: speculative decoding samples the same
distribution. Repetition penalty also reads the prompt (the decode node of a disaggregated request has it).

The engine's runner keeps those counts and the prompt's tokens on the device, per state slot (`ResidentCounts`,
`penalty_counts`): set from the host history once when a request enters its slot, then grown in stream order by
every step from the tokens it decides (`count_decided`), so a step's host work per penalised row is a few scalars
and a step in flight's token is counted without a host read. Without them (`resident` None) the inputs carry the
host-known generated tokens and prompt as flat (row, token) pairs, with the newest output as an `anchor` (it may be
a step in flight's, still on the device: `with_anchor`).

Everything on the device is a function of device tensors alone (no host read, no per-row loop): the per-row
inputs come in one host -> device copy (`logits_inputs`), and the per-token lists (bias, stop ids, and the
history without resident counts) as flat (row, token) pairs scattered into [P, V]. Only the P rows that have
something to process are gathered and processed (their [P, K+1, V] working copies do not grow with the rest of
the batch).

Each op runs in float32 on the logits as the model gave them; the result is rounded once to the logits' dtype
before min_p (whose threshold is then the rounded maximum's, and whose test is on the rounded values). A 16-bit
engine so samples processed rows from 16-bit logits, as it samples the rows without processing: the rounding is the
model's own output precision, and the draw, the argmax and the logprob passes read half the bytes they would from
float32 rows.

This module's `apply_processing` is the torch reference, which CPU engines run; on a GPU the engine runs
`ops.logits_process`' kernels (`Kernels.process_logits`), which read the same inputs (plus `index`, `bias_start`
and `stop_start`) and give the same logits in two launches.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor

from .host_copy import float_bits, to_device
from .request import PENDING
from .sampling_params import SamplingParams


@dataclass(frozen=True)
class RowHistory:
    """What processing reads of one request besides its params: prompt ids, output ids so far (the newest may be
    PENDING) and its stop ids (EOS unless ignore_eos, plus stop_token_ids)."""

    prompt: Sequence[int]
    outputs: Sequence[int]
    stop_ids: frozenset[int]


@dataclass(frozen=True)
class ResidentCounts:
    """The penalty inputs a runner keeps on the device (`penalty_counts.PenaltyCounts`): by slot, `counts` [S+1, V]
    int32 (how often the slot's request generated each token, its steps in flight included) and `prompt_bits`
    [S+1, words] int32 (its prompt's tokens, bit t % 32 of word t // 32; none where it has no repetition penalty);
    row S of each is all zeros, which the processed rows without penalties read. `slots`: per batch row, the slot
    of its request (read for penalised rows only)."""

    counts: Tensor
    prompt_bits: Tensor
    slots: Sequence[int]


@dataclass(frozen=True)
class LogitsInputs:
    """One step's processing inputs on the device, for the P processed rows: `rows` [P], their rows in the batch
    (`batch_rows` on the host). Per processed row [P]: `anchor` (the row's newest token, counted as generated
    where `anchor_counts` is 1), `min_left` (outputs still to come before a stop id may be decided), and float32
    `presence`, `frequency`, `repetition`, `min_p` (0 on greedy rows), `temperature`. Flat pairs, by processed
    row: `gen` (row, token) of host-known generated tokens, `prompt` (row, token), `bias` (row, token) with
    `bias_values`, `stop` (row, token). `grammar`: the grammar rows' token masks, by position. The flags say which ops run (host bools: no device read).
    With `ResidentCounts` (`counts` not None) `gen` and `prompt` are empty and no anchor is counted: a processed
    row's counts and prompt bits are rows `count_rows` [P] of `counts` / `prompt_bits`, and the penalised rows
    (batch rows `record_rows`, slots `record_slots`) get the tokens the step decides added (`count_decided`)."""

    rows: Tensor
    batch_rows: tuple[int, ...]
    num_rows: int  # rows in the batch (R)
    anchor: Tensor
    anchor_counts: Tensor
    min_left: Tensor
    presence: Tensor
    frequency: Tensor
    repetition: Tensor
    min_p: Tensor
    temperature: Tensor
    gen: Tensor        # [2, n_gen]
    prompt: Tensor     # [2, n_prompt]
    bias: Tensor       # [2, n_bias]
    bias_values: Tensor  # [n_bias] float32
    stop: Tensor       # [2, n_stop]
    # [P, K+1, words] int32 allowed-token bitmasks (bit t % 32 of word t // 32), all ones on rows without a grammar
    grammar: Tensor | None
    penalised: bool
    repetition_used: bool
    biased: bool
    min_tokens: bool
    min_p_used: bool
    counts: Tensor | None = None       # [S+1, V] int32 (`ResidentCounts`)
    prompt_bits: Tensor | None = None  # [S+1, words] int32
    count_rows: Tensor | None = None   # [P] int64
    record_rows: Tensor | None = None  # [n] int64, batch rows
    record_slots: Tensor | None = None  # [n] int64
    # For the one-pass kernel (`ops.logits_process`): per batch row its processed row or -1 [R], and where each
    # processed row's run of `bias` / `stop` pairs starts [P+1] (the pairs come row by row, tokens ascending).
    index: Tensor | None = None
    bias_start: Tensor | None = None
    stop_start: Tensor | None = None

    def with_anchor(self, rows: Sequence[int], tokens: Tensor) -> LogitsInputs:
        """These inputs with the anchors of batch rows `rows` (host ints) set to `tokens` ([len(rows)], a step in
        flight's tokens, on the device); rows that are not processed are left out."""
        if any(not isinstance(r, int) for r in rows):
            raise ValueError(f"rows: expected host ints (batch rows), got {rows!r}")
        at = {r: i for i, r in enumerate(self.batch_rows)}
        pairs = [(i, at[r]) for i, r in enumerate(rows) if r in at]
        if not pairs:
            return self
        dev = self.anchor.device
        anchor = self.anchor.clone()
        anchor[to_device([p for _, p in pairs], torch.int64, dev)] = tokens[to_device([i for i, _ in pairs],
                                                                                       torch.int64, dev)]
        return replace(self, anchor=anchor)


def needs_processing(params: SamplingParams, num_outputs: int) -> bool:
    """Whether a row with `num_outputs` outputs so far has anything to process (a min_tokens already reached
    has not)."""
    return (params.penalised or bool(params.logit_bias) or num_outputs < params.min_tokens
            or (params.min_p > 0 and not params.greedy) or params.structured_output is not None)


def logits_inputs(params: Sequence[SamplingParams], histories: Sequence[RowHistory], device: torch.device,
                  grammar: Mapping[int, np.ndarray] | None = None, resident: ResidentCounts | None = None
                  ) -> LogitsInputs | None:
    """The rows' inputs in one copy, or None when no row has anything to process. A row's anchor is its newest
    output (PENDING: to be set with `with_anchor`), counted when it has one. `grammar`: by batch row, the token
    masks ([K+1, words] int32, `Grammars.masks`) of the rows with a grammar. `resident`: the penalised rows' counts
    and prompts are read on the device from there (nothing of their history is copied, no anchor is counted)."""
    if len(histories) != len(params):
        raise ValueError(f"histories: expected one per row ({len(params)}), got {len(histories)}")
    if resident is not None and len(resident.slots) != len(params):
        raise ValueError(f"resident.slots: expected one per row ({len(params)}), got {len(resident.slots)}")
    batch_rows = [i for i, (p, h) in enumerate(zip(params, histories, strict=True))
                  if needs_processing(p, len(h.outputs))]
    if not batch_rows:
        return None
    num_rows = len(params)
    params = [params[i] for i in batch_rows]
    histories = [histories[i] for i in batch_rows]
    n = len(params)
    anchor, counted, left = [], [], []
    gen: tuple[list[int], list[int]] = ([], [])
    prompt: tuple[list[int], list[int]] = ([], [])
    bias: tuple[list[int], list[int]] = ([], [])
    stop: tuple[list[int], list[int]] = ([], [])
    bias_values: list[float] = []
    count_rows: list[int] = []
    record: tuple[list[int], list[int]] = ([], [])
    for r, (p, h) in enumerate(zip(params, histories, strict=True)):
        outs = h.outputs
        left.append(max(p.min_tokens - len(outs), 0))
        if resident is not None:
            # The counts are on the device, the newest token's included: nothing of the history travels.
            anchor.append(0)
            counted.append(0)
            slot = resident.slots[batch_rows[r]] if p.penalised else resident.counts.shape[0] - 1
            count_rows.append(slot)
            if p.penalised:
                record[0].append(batch_rows[r])
                record[1].append(slot)
        else:
            anchor.append(max(outs[-1], 0) if outs else 0)
            counted.append(1 if outs and p.penalised else 0)
        if p.penalised and resident is None:
            older = outs[:-1]
            if PENDING in older:
                raise ValueError(f"histories: expected at most the newest output PENDING, got {list(outs)}")
            gen[0].extend([r] * len(older))
            gen[1].extend(older)
        if p.repetition_penalty != 1 and resident is None:
            prompt[0].extend([r] * len(h.prompt))
            prompt[1].extend(h.prompt)
        for t, b in p.logit_bias:
            bias[0].append(r)
            bias[1].append(t)
            bias_values.append(b)
        if left[-1]:
            stop[0].extend([r] * len(h.stop_ids))
            stop[1].extend(sorted(h.stop_ids))
    floats = ([p.presence_penalty for p in params] + [p.frequency_penalty for p in params]
              + [p.repetition_penalty for p in params] + [0.0 if p.greedy else p.min_p for p in params]
              + [p.temperature for p in params] + bias_values)
    index = [-1] * num_rows
    for r, b in enumerate(batch_rows):
        index[b] = r
    bias_start = np.searchsorted(bias[0], np.arange(n + 1)).tolist()
    stop_start = np.searchsorted(stop[0], np.arange(n + 1)).tolist()
    parts = [batch_rows, anchor, counted, left, *gen, *prompt, *bias, *stop, count_rows, *record, index, bias_start,
             stop_start]
    buf = to_device([v for part in parts for v in part] + float_bits(floats), torch.int64, device)
    views: list[Tensor] = []
    at = 0
    for part in parts:
        views.append(buf[at:at + len(part)])
        at += len(part)
    f = buf[at:].to(torch.int32).view(torch.float32)
    masks = None
    if grammar:
        width, words = next(iter(grammar.values())).shape
        host = np.full((n, width, words), -1, dtype=np.int32)
        for r, b in enumerate(batch_rows):
            if b in grammar:
                host[r] = grammar[b]
        masks = torch.from_numpy(host).to(device)
    rows, a, c, m, g0, g1, p0, p1, b0, b1, s0, s1, cr, r0, r1, ix, bs, ss = views
    return LogitsInputs(
        rows=rows, batch_rows=tuple(batch_rows), num_rows=num_rows, anchor=a, anchor_counts=c, min_left=m,
        presence=f[:n], frequency=f[n:2 * n], repetition=f[2 * n:3 * n], min_p=f[3 * n:4 * n], temperature=f[4 * n:5 * n], gen=torch.stack([g0, g1]), prompt=torch.stack([p0, p1]),
        bias=torch.stack([b0, b1]), bias_values=f[5 * n:], stop=torch.stack([s0, s1]), grammar=masks,
        penalised=any(p.penalised for p in params), repetition_used=any(p.repetition_penalty != 1 for p in params),
        biased=bool(bias_values), min_tokens=any(left), min_p_used=any(p.min_p > 0 and not p.greedy for p in params),
        counts=None if resident is None else resident.counts,
        prompt_bits=None if resident is None else resident.prompt_bits,
        count_rows=None if resident is None else cr, record_rows=None if resident is None else r0,
        record_slots=None if resident is None else r1, index=ix, bias_start=bs, stop_start=ss)


def pair_mask(pairs: Tensor, R: int, V: int, device: torch.device) -> Tensor:
    """(row, token) pairs [2, n] -> [R, V] bool, True at each pair."""
    m = torch.zeros(R, V, dtype=torch.bool, device=device)
    return m.index_put_((pairs[0], pairs[1]), torch.ones_like(pairs[0], dtype=torch.bool))


def host_list_counts(inputs: LogitsInputs, V: int, device: torch.device) -> Tensor:
    """Without resident counts: how often each processed row generated each token before the step, from the
    host-known outputs and the anchor -> [P, V] float32."""
    base = torch.zeros(len(inputs.batch_rows), V, dtype=torch.float32, device=device)
    base.index_put_((inputs.gen[0], inputs.gen[1]), torch.ones(inputs.gen.shape[1], device=device), accumulate=True)
    return base.scatter_add_(1, inputs.anchor[:, None], inputs.anchor_counts[:, None].float())


def generated_counts(inputs: LogitsInputs, drafts: Tensor, num_draft: Tensor, V: int) -> Tensor:
    """How often each token was generated before each position a processed row decides: drafts [P, K] int64
    (padding in range), num_draft [P] -> [P, K+1, V] float32; position j counts the host-known outputs, the anchor
    and drafts 0..j-1."""
    R, K = drafts.shape
    dev = drafts.device
    if inputs.counts is not None:
        base = inputs.counts[inputs.count_rows].float()  # [R, V] (exact: a count is far below 2**24)
    else:
        base = host_list_counts(inputs, V, dev)
    if K == 0:
        return base[:, None]
    valid = (torch.arange(K, device=dev)[None, :] < num_draft[:, None]).float()  # [R, K]
    # Draft j is generated before position j + 1: one-hot at (j + 1), summed over positions.
    step = torch.zeros(R, K + 1, V, dtype=torch.float32, device=dev)
    step[:, 1:].scatter_(2, drafts[:, :, None], valid[:, :, None])
    return base[:, None] + step.cumsum(dim=1)


def apply_processing(logits: Tensor, drafts: Tensor, num_draft: Tensor, inputs: LogitsInputs) -> Tensor:
    """logits [R, K+1, V] (raw, any float dtype), drafts [R, K] (padding: any value), num_draft [R] on the
    logits' device -> the processed logits [R, K+1, V] in the logits' dtype (a new tensor; rows not processed as
    they were)."""
    R, K1, V = logits.shape
    if inputs.num_rows != R:
        raise ValueError(f"logits: expected the {inputs.num_rows} rows the inputs were built for, got {R}")
    dev = logits.device
    out = logits.to(torch.float32, copy=True)
    every = len(inputs.batch_rows) == R
    num_draft = num_draft.to(device=dev, dtype=torch.int64)
    valid = torch.arange(K1 - 1, device=dev)[None, :] < num_draft[:, None]
    drafts = torch.where(valid, drafts.to(dev, torch.int64), 0)  # [R, K], padding zeroed (never counted)
    if every:  # (no gather: every row is processed, in batch order)
        return _processed(out, drafts, num_draft, inputs, logits.dtype).to(logits.dtype)
    rows = inputs.rows
    out[rows] = _processed(out[rows], drafts[rows], num_draft[rows], inputs, logits.dtype)
    return out.to(logits.dtype)


def _processed(z: Tensor, drafts: Tensor, num_draft: Tensor, inputs: LogitsInputs, dtype: torch.dtype) -> Tensor:
    """`apply_processing` on the processed rows alone: z [P, K+1, V] float32 (modified), drafts [P, K] (padding
    zeroed), num_draft [P] -> [P, K+1, V] float32, its values those of `dtype` (the logits')."""
    R, K1, V = z.shape
    dev = z.device
    if inputs.grammar is not None:
        z = z.masked_fill(~allowed_tokens(inputs.grammar, V), float("-inf"))
    if inputs.biased:
        bias = torch.zeros(R, V, dtype=torch.float32, device=dev)
        bias.index_put_((inputs.bias[0], inputs.bias[1]), inputs.bias_values, accumulate=True)
        z += bias[:, None]
    if inputs.min_tokens:
        early = torch.arange(K1, device=dev)[None, :] < inputs.min_left[:, None]  # [R, K+1]
        stop = pair_mask(inputs.stop, R, V, dev)  # [R, V]
        z = z.masked_fill(early[:, :, None] & stop[:, None], float("-inf"))
    if inputs.penalised:
        counts = generated_counts(inputs, drafts, num_draft, V)  # [R, K+1, V]
        seen = counts > 0
        if inputs.repetition_used:
            rep = inputs.repetition[:, None, None]
            in_prompt = (pair_mask(inputs.prompt, R, V, dev) if inputs.prompt_bits is None
                         else allowed_tokens(inputs.prompt_bits[inputs.count_rows], V))  # [R, V]
            seen_any = seen | in_prompt[:, None]
            z = torch.where(seen_any, torch.where(z > 0, z / rep, z * rep), z)
        z = z - inputs.frequency[:, None, None] * counts - inputs.presence[:, None, None] * seen.float()
    z = z.to(dtype).float()
    if inputs.min_p_used:
        zmax = z.amax(dim=-1, keepdim=True)  # [R, K+1, 1]
        used = inputs.min_p > 0
        log_min_p = torch.log(torch.where(used, inputs.min_p, 1.0))
        # A row without min_p keeps everything: its threshold is -inf.
        thr = torch.where(used[:, None, None], zmax + (inputs.temperature * log_min_p)[:, None, None],
                          float("-inf"))
        z = z.masked_fill(z < thr, float("-inf"))
    return z


def count_decided(inputs: LogitsInputs, tokens: Tensor) -> None:
    """Add the tokens a step decided for the penalised rows to their resident counts, on the device (stream order:
    the next step's processing reads them): tokens [R] or [R, T] by batch row, negative entries (a verify row's
    positions past its emitted tokens) not counted. Nothing without resident counts or penalised rows."""
    if inputs.counts is None or not inputs.penalised:
        return
    got = tokens[inputs.record_rows]  # [n] or [n, T]
    if got.dim() == 1:
        got = got[:, None]
    slots = inputs.record_slots[:, None].expand_as(got)
    counted = got >= 0
    inputs.counts.index_put_((slots, torch.where(counted, got, 0)), counted.to(inputs.counts.dtype), accumulate=True)


def allowed_tokens(bits: Tensor, V: int) -> Tensor:
    """Bitmasks [..., words] int32 (bit t % 32 of word t // 32) -> [..., V] bool; tokens past the words' width
    are not allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    allowed = ((bits[..., None] >> shifts) & 1).bool().flatten(-2)  # [..., words * 32]
    if allowed.shape[-1] >= V:
        return allowed[..., :V]
    pad = torch.zeros(*allowed.shape[:-1], V - allowed.shape[-1], dtype=torch.bool, device=bits.device)
    return torch.cat([allowed, pad], dim=-1)
