"""The model runner: the only place where the scheduler's ints become tensors.

`execute(out)` builds the varlen `ForwardBatch`, runs the model once over all rows (decode rows and prefill
chunks together), gathers the last token of every row that samples, and samples one token per such row.

With speculative decoding (K > 0, `spec_runner.SpecRunner` does the rest) decode rows are verify rows; how
many recorded positions a row replays into its state first is read on the device from `replay` (R3), never
from a host copy.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from baton.engine.cache_pools import CachePools
from baton.engine.causal_lm import CausalLM
from baton.engine.cuda_graphs import StepGraphs
from baton.engine.forward_batch import CheckpointRows, ForwardBatch
from baton.engine.grammar import Grammars
from baton.engine.host_copy import to_device
from baton.engine.logits_processing import (
    LogitsInputs,
    ResidentCounts,
    RowHistory,
    count_decided,
    logits_inputs,
    needs_processing,
)
from baton.engine.logprobs import LogprobRows, Segment, TokenLogprob
from baton.engine.mixed_graph_buckets import MixedGraphBuckets
from baton.engine.mixed_graphs import DecodeRows, PromptChunk
from baton.engine.penalty_counts import PenaltyCounts
from baton.engine.pending_step import PendingStep, device_mark, fill_pending
from baton.engine.rejection_sampler import RejectionSampler
from baton.engine.request import PENDING
from baton.engine.sample_inputs import sample_inputs
from baton.engine.sampling import request_seed
from baton.engine.sampling_params import SamplingParams
from baton.engine.scheduler_output import SchedulerOutput


def kv_slots(block_ids: Sequence[int], start: int, end: int, block_size: int) -> range | list[int]:
    """Flat KV slots (block * block_size + offset) of positions start..end-1 of a row with these blocks."""
    if (end - 1) // block_size == start // block_size:
        # All in one block (always so for a decode row): consecutive slots, no per-position arithmetic.
        first = block_ids[start // block_size] * block_size + start % block_size
        return range(first, first + end - start)
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]


@dataclass
class StepOutput:
    # request id -> its next token, or with speculative decoding the tokens it emitted (accepted drafts,
    # then one sampled token)
    sampled: dict[str, int] | dict[str, list[int]]
    logits: dict[str, torch.Tensor] | None = None  # request id -> [V] float32, when asked for
    drafts: dict[str, list[int]] = field(default_factory=dict)  # request id -> the next step's drafts
    device_seconds: float = 0.0  # the step's GPU time (pending_step.device_mark), 0.0 off CUDA
    # request id -> (0, logprobs of its emitted tokens, in order; with drafts one per verified position: the first
    # len(sampled[id]) are the emitted tokens'), for requests with SamplingParams.logprobs
    logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)
    # request id -> (index of the first prompt token scored, logprobs of the prompt tokens this step scored)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)


@dataclass(frozen=True)
class PromptScores:
    """The prompt positions a step scores for prompt_logprobs: per scored position, its flat token index in the
    step (`flat`) and the prompt token it predicts (`targets`), with a `Segment` per request."""

    flat: list[int]
    targets: list[int]
    segments: list[Segment]


class ModelRunner:
    def __init__(self, model: CausalLM, pools: CachePools, block_size: int,
                 device: torch.device | str) -> None:
        self.model = model
        # CUDA graphs of decode (or verify) steps, set by the engine where they can run; None: all eager.
        self.graphs: StepGraphs | None = None
        # CUDA graphs of decode rows + one prompt chunk (EngineConfig.mixed_graph_tokens); None: those run eagerly.
        self.mixed_graphs: MixedGraphBuckets | None = None
        # Steps replayed as a decode (verify) graph and as a mixed graph, since start; the others ran eagerly.
        self.graph_steps = 0
        self.mixed_graph_steps = 0
        # Steps of at most this many tokens run the fused-prologue GEMVs (EngineConfig.fused_gemv_max_tokens).
        self.fused_gemv_max_tokens = 0
        self.pools = pools
        self.block_size = block_size
        self.device = torch.device(device)
        # Draws each row's next token (`RejectionSampler.sample`); a spec runner's verifies drafts too.
        self.rejection = RejectionSampler(0, model.kernels, model.tp)
        self._sampling: dict[str, tuple[SamplingParams, int]] = {}  # params and noise seed (`request_seed`)
        # The requests whose logits are processed (`logits_processing`): their prompt, outputs and stop ids.
        self._history: dict[str, RowHistory] = {}
        # The penalised requests' incarnations (one number per add_request: an id may be reused), which own the
        # counts of their state slot in `penalties` (`penalty_counts`).
        self._penalised: dict[str, int] = {}
        self._incarnations = itertools.count()
        self.penalties = PenaltyCounts(pools.plan.num_slots, model.cfg.vocab_size, self.device)
        # The prompt length of each request with prompt_logprobs (`prompt_scores`).
        self._prompt_len: dict[str, int] = {}
        # The requests with logprobs: while there are none, a step spends nothing on them.
        self._with_logprobs: set[str] = set()
        # The matchers of requests with a structured_output; None: no tokenizer, such requests are refused.
        self.grammars: Grammars | None = None
        self._kv, self._states = pools.kv_layers(), pools.state_layers()
        self._verify_inputs = pools.verify_layers()
        # The `keep` of a forward whose outputs nobody reads (a step of prompt chunks that sample nothing).
        self._no_tokens = torch.empty(0, dtype=torch.int64, device=self.device)
        # Per state slot: how many recorded positions of its last verify were accepted (1 + accepted drafts),
        # to be replayed into the state by the next step. Written only by steps on the device (R3); 0 for a
        # fresh, prefilled or transferred request. (One more entry: the scratch slot of graph padding rows.)
        self.replay = torch.zeros(pools.plan.num_slots + 1, dtype=torch.int64, device=self.device)

    # ---- per-request sampling state -------------------------------------------------------------
    def add_request(self, request_id: str, params: SamplingParams, history: RowHistory | None = None) -> None:
        """`history` (a request with params.processed): its prompt, its output list (read as it grows) and its
        stop ids."""
        self._sampling[request_id] = (params, request_seed(params.seed))
        if params.logprobs is not None:
            self._with_logprobs.add(request_id)
        else:  # (an id a finished request had may be reused)
            self._with_logprobs.discard(request_id)
        if params.processed:
            if history is None:
                raise ValueError(f"history: expected the prompt and outputs of {request_id!r}, whose logits are "
                                 f"processed (penalties, logit_bias, min_tokens or min_p), got None")
            self._history[request_id] = history
        if params.penalised:
            self._penalised[request_id] = next(self._incarnations)
        else:
            self._penalised.pop(request_id, None)
        if params.prompt_logprobs is not None:
            if history is None:
                raise ValueError(f"history: expected the prompt of {request_id!r}, which asks for prompt_logprobs, "
                                 f"got None")
            self._prompt_len[request_id] = len(history.prompt)
        else:
            self._prompt_len.pop(request_id, None)
        if params.structured_output is not None:
            if self.grammars is None:
                raise ValueError("structured_output: expected an engine that knows its checkpoint's tokenizer "
                                 "(tokenizer.json), got one without")
            self.grammars.add(request_id, params.structured_output, history.outputs)

    def remove_request(self, request_id: str) -> None:
        self._sampling.pop(request_id, None)
        self._history.pop(request_id, None)
        self._penalised.pop(request_id, None)
        self._prompt_len.pop(request_id, None)
        self._with_logprobs.discard(request_id)
        if self.grammars is not None:
            self.grammars.remove(request_id)

    def wants_logprobs(self, request_ids: Sequence[str]) -> bool:
        """Whether any of these requests asks for logprobs: a verify step of such rows runs eagerly (its graph
        returns no logits) and is never chained."""
        return bool(self._with_logprobs) and any(r in self._with_logprobs for r in request_ids)

    def prompt_scores(self, out: SchedulerOutput) -> PromptScores | None:
        """The prompt positions this step scores (None: none). Position p of a prompt of N tokens predicts prompt
        token p + 1 for p <= N - 2: a chunk scores its positions up to there, the last one's target being the
        chunk's successor. Only prefill rows of requests with prompt_logprobs; a recompute after preemption
        scores its prompt part again (the same values)."""
        if not self._prompt_len:
            return None
        flat: list[int] = []
        targets: list[int] = []
        segments: list[Segment] = []
        starts = out.token_starts
        for i, r in enumerate(out.rows):
            n = self._prompt_len.get(r.request_id)
            if n is None or r.is_decode:
                continue
            c = r.num_computed_tokens
            count = min(c + r.num_tokens, n - 1) - c
            if count <= 0:
                continue
            ids = r.token_ids[1:count + 1]
            if len(ids) < count:  # the chunk's last position predicts the chunk's successor
                ids = (*ids, r.next_token)
            flat.extend(range(starts[i], starts[i] + count))
            targets.extend(ids)
            segments.append(Segment(r.request_id, count, self._sampling[r.request_id][0].prompt_logprobs, c + 1))
        return PromptScores(flat, targets, segments) if segments else None

    def output_logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, ids: Sequence[str],
                        params: Sequence[SamplingParams], rows: torch.Tensor | None, per_row: int = 1
                        ) -> LogprobRows | None:
        """The logprobs of the rows that asked for them: logits [R, V] (processed), tokens [R] the tokens they
        decide, rows: those rows' indices on the device, built before the forward (None: every row); `per_row`
        consecutive logits rows per request (a verify row's positions)."""
        if not self._with_logprobs:
            return None
        asked = [(r, p.logprobs) for r, p in zip(ids, params, strict=True) if p.logprobs is not None]
        if not asked:
            return None
        if rows is not None:
            logits, tokens = logits[rows], tokens[rows]
        packed = self.model.kernels.logprob_pack(logits, tokens, max(k for _, k in asked))
        return LogprobRows(packed, [Segment(r, per_row, k) for r, k in asked])

    def logprob_rows(self, params: Sequence[SamplingParams], per_row: int = 1) -> torch.Tensor | None:
        """The device indices of the logits rows of requests with logprobs (`output_logprobs`' rows), None when
        every row (or none) asks: built before the forward."""
        if not self._with_logprobs:
            return None
        asked = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not asked or len(asked) == len(params):
            return None
        return self._t([i * per_row + j for i in asked for j in range(per_row)])

    def has_grammar(self) -> bool:
        """Whether any request holds a grammar: the engine then reads every step before the next launch."""
        return bool(self.grammars)

    def grammar_complete(self, request_id: str) -> bool:
        """Whether the request's grammar is complete after its outputs so far (False: it has none)."""
        return self.grammars is not None and request_id in self.grammars and self.grammars.catch_up(request_id)

    def processes(self, request_ids: Sequence[str]) -> bool:
        """Whether any of these requests' logits are processed: such rows are never chained (a grammar's mask
        needs the previous step's tokens on the host), and a verify step of them replays its graph only where the
        graph holds their processing (`SpecRunner.graph_processes`)."""
        if not self._history:
            return False
        hist = [(r, self._history.get(r)) for r in request_ids]
        return any(h is not None and needs_processing(self._sampling[r][0], len(h.outputs)) for r, h in hist)

    def processing_of(self, request_ids: Sequence[str], params: Sequence[SamplingParams], slots: Sequence[int],
                      drafts: Sequence[Sequence[int]] | None = None, width: int = 1) -> LogitsInputs | None:
        """The rows' logits processing inputs (None: nothing to process); `slots`: the rows' state slots, where
        the penalised rows' counts live (`penalty_counts`; set from a row's history where its slot holds another
        request's). A request without a history has nothing to process. `drafts` (verify rows) and `width` (their
        positions) place the grammar rows' masks. The step must pass the tokens it decides to `count_decided`."""
        if not self._history:
            return None
        empty = RowHistory((), (), frozenset())
        hist = [self._history.get(r, empty) for r in request_ids]
        g = self.grammars
        masks = None if not g else {i: g.masks(r, drafts[i] if drafts else (), width)
                                    for i, r in enumerate(request_ids) if r in g}
        return logits_inputs(params, hist, self.device, masks, self.resident_counts(request_ids, params, slots))

    def resident_counts(self, request_ids: Sequence[str], params: Sequence[SamplingParams], slots: Sequence[int],
                        allocate: bool = False) -> ResidentCounts | None:
        """The penalty tables for these rows (None where none is penalised, unless `allocate`), a penalised row's
        slot set from its history first where the slot holds another request's counts (`penalty_counts`)."""
        owners = [self._penalised.get(r) for r in request_ids]
        if not allocate and all(o is None for o in owners):
            return None
        empty = RowHistory((), (), frozenset())
        hist = [self._history.get(r, empty) for r in request_ids]
        return self.penalties.resident(slots, owners, hist, [p.repetition_penalty != 1 for p in params])

    def reset_slot(self, slot: int) -> None:
        """A transferred state arrives whole in its slot: nothing to replay."""
        self.replay[slot] = 0

    def restore_checkpoints(self, out: SchedulerOutput) -> None:
        """Before the step's forward: requests resuming from a cached prefix get its state checkpoint in their slot,
        whole (nothing to replay), and each checkpoint row's lent slot gets its row's initial state. Device copies,
        queued before the forward that reads them."""
        if out.restores:
            self.pools.copy_slots(out.restores, to_checkpoints=False)
            for _, slot in out.restores:
                self.replay[slot] = 0
        if out.checkpoint_rows:
            # A checkpoint row starts from its row's initial state (restored above where it resumes from one).
            rows = {r.request_id: r for r in out.rows}
            forks = [(rows[c.request_id].state_slot, c.slot) for c in out.checkpoint_rows
                     if rows[c.request_id].has_initial_state]
            if forks:
                self.pools.fork_slots(forks)

    def take_checkpoints(self, out: SchedulerOutput) -> None:
        """After the step's forward: the state of each chunk that ended on a checkpoint boundary, copied on the
        device into its checkpoint slot (a later step's restore runs after it on the same stream)."""
        if out.checkpoints:
            self.pools.copy_slots(out.checkpoints, to_checkpoints=True)

    # ---- one step ---------------------------------------------------------------------------------
    def _t(self, x: list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return to_device(x, dtype, self.device)

    def build_batch(self, out: SchedulerOutput, spec: bool = False) -> tuple[torch.Tensor, ForwardBatch]:
        bs = self.block_size
        input_ids: list[int] = []
        qsl = out.token_starts
        slot_mapping: list[int] = []
        max_blocks = max(len(r.block_ids) for r in out.rows)
        block_tables = []
        for row in out.rows:
            input_ids.extend(row.token_ids)
            start = row.num_computed_tokens
            slot_mapping += kv_slots(row.block_ids, start, start + row.num_tokens, bs)
            block_tables.append(list(row.block_ids) + [0] * (max_blocks - len(row.block_ids)))

        t = self._t
        slots = t([r.state_slot for r in out.rows])
        has_init = t([r.has_initial_state for r in out.rows], torch.bool)
        # A row without a state starts afresh (R2/R3): nothing to replay. Set on the device, no host copy.
        replay = torch.where(has_init, self.replay[slots], 0)
        self.replay[slots] = replay
        batch = ForwardBatch(
            num_decodes=out.num_decodes,
            query_start_loc=t(qsl),
            seq_lens=t([r.num_computed_tokens + r.num_tokens for r in out.rows]),
            block_tables=t(block_tables),
            slot_mapping=t(slot_mapping),
            state_slots=slots,
            has_initial_state=has_init,
            kv_caches=self._kv,
            mixer_states=self._states,
        )
        # (Where the Triton kernels run: the torch reference would run the same ops, only one by one.)
        batch.fused_gemv = len(input_ids) <= self.fused_gemv_max_tokens and self.model.kernels.triton
        if spec and out.num_decodes:
            self._add_verify_layout(out, batch, replay, qsl)
        cfg = self.model.cfg
        if self._kv and self.model.kernels.triton:
            from baton.engine.ops.attention.kernel import build_attention_meta
            batch.attention_meta = build_attention_meta(qsl, batch.query_start_loc, cfg.num_attention_heads,
                                                        cfg.num_key_value_heads, cfg.head_dim)
        nd = out.num_decodes
        if nd < len(out.rows) and self._states:
            base = qsl[nd]
            starts = [q - base for q in qsl[nd:]]
            if out.checkpoint_rows:
                batch.checkpoint_rows, starts = self._checkpoint_rows(out, starts)
            batch.prefill_chunk_meta = self.model.recurrent_mixer.prefill_meta(cfg, starts, self.model.kernels,
                                                                               self.device)
        return t(input_ids), batch

    def _checkpoint_rows(self, out: SchedulerOutput, starts: list[int]) -> tuple[CheckpointRows, list[int]]:
        """The prefill rows' sequences (query starts `starts`, from 0) with the checkpoint rows appended, and their
        query starts."""
        nd = out.num_decodes
        row_of = {r.request_id: i for i, r in enumerate(out.rows[nd:])}
        index: list[int] = []
        starts = list(starts)
        slots = [r.state_slot for r in out.rows[nd:]]
        init = [r.has_initial_state for r in out.rows[nd:]]
        for c in out.checkpoint_rows:
            i = row_of[c.request_id]
            index += range(starts[i], starts[i] + c.num_tokens)
            starts.append(starts[-1] + c.num_tokens)
            slots.append(c.slot)
            init.append(init[i])
        t = self._t
        return CheckpointRows(t(index), t(starts), t(slots), t(init, torch.bool)), starts

    def _add_verify_layout(self, out: SchedulerOutput, batch: ForwardBatch, replay: torch.Tensor,
                           qsl: list[int]) -> None:
        """Verify rows as [Rd, T]: token (b, t) is flat token qsl[b] + t."""
        nd = out.num_decodes
        lens = [r.num_tokens for r in out.rows[:nd]]
        T = max(lens)
        batch.num_decode_tokens = qsl[nd]
        batch.spec_num_tokens = self._t(lens)
        batch.spec_token_index = self._t([[qsl[b] + min(j, n - 1) for j in range(T)] for b, n in enumerate(lens)])
        batch.spec_replay = replay[:nd]
        batch.verify_inputs = self._verify_inputs
        batch.spec_flat_index = self._t([b * T + j for b, n in enumerate(lens) for j in range(n)])
        batch.spec_uniform = all(n == T for n in lens)

    @torch.inference_mode()
    def forward_hidden(self, out: SchedulerOutput) -> tuple[torch.Tensor, ForwardBatch]:
        self.restore_checkpoints(out)
        input_ids, batch = self.build_batch(out)
        hidden = self.model(input_ids, batch)
        self.take_checkpoints(out)
        return hidden, batch

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, return_logits: bool = False) -> StepOutput:
        """Run one step and wait for its tokens."""
        if not out.rows:
            return StepOutput(sampled={})
        pending = self.launch(out, return_logits=return_logits)
        sampled, logits = pending.result()
        lps, prompt_lps = pending.read_logprobs()
        return StepOutput(sampled=sampled, logits=(logits or {}) if return_logits else None,
                          device_seconds=pending.device_seconds(), logprobs=lps, prompt_logprobs=prompt_lps)

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, prev: PendingStep | None = None,
               return_logits: bool = False) -> PendingStep:
        """Queue one step on the device and return at once; its tokens come back through `result()`.

        A decode row whose last token is PENDING (sampled by `prev`, a step launched before this one whose
        tokens are not read yet) takes it from prev's token tensor on the device."""
        sample_rows = [i for i, r in enumerate(out.rows) if r.sample]
        # Built before the forward, in one copy: the sampling rows' noise seeds, the positions of the tokens they
        # draw and their parameters (none when every row is greedy).
        rows_s = [out.rows[i] for i in sample_rows]
        ids = [r.request_id for r in rows_s]
        params = [self._sampling[r][0] for r in ids]
        inputs = None if all(p.greedy for p in params) else sample_inputs(
            params, [self._sampling[r][1] for r in ids], [r.num_computed_tokens + r.num_tokens for r in rows_s],
            self.device)
        processing = self.processing_of(ids, params, [r.state_slot for r in rows_s])
        decided = processing  # (the penalised rows' counts grow by the tokens decided)
        lp_rows = self.logprob_rows(params)
        scores = self.prompt_scores(out)
        prompt_lps = None
        fill = self._pending_inputs(out, prev)
        self.restore_checkpoints(out)
        if self._graphable(out) and len(sample_rows) == len(out.rows):
            logits = self._decode_graph(out, fill=fill)
            started = self.graphs.started
        elif self._mixed_graphable(out) and scores is None:
            logits = self._mixed_graph(out, fill=fill)
            started = self.mixed_graphs.started
            self.take_checkpoints(out)
        else:
            input_ids, batch = self.build_batch(out)
            if fill is not None:
                fill_pending(input_ids, *fill)
            # The logits gather: the last token of every row that samples (R5); from host ints, before the
            # forward (indexing a device tensor with a host list would copy the list and wait). Only those
            # tokens go through the layers past the last cache-writing one (none: a step of prompt chunks that
            # sample nothing writes its caches only; all, with no gather, when every token samples: decode rows).
            starts = out.token_starts
            keep = (None if len(sample_rows) == starts[-1] else self._no_tokens if not sample_rows
                    else self._t([starts[i + 1] - 1 for i in sample_rows]))
            prompt_at = None
            if scores is not None:
                # The scored prompt positions ride in the gather too: [scored..., sampling rows' last tokens].
                flat = scores.flat + [starts[i + 1] - 1 for i in sample_rows]
                keep = self._t(flat)
                targets = self._t(scores.targets)
                prompt_at = len(scores.flat)
            started = device_mark(self.device)
            hidden = self.model(input_ids, batch, keep=keep)  # [R_s (+ scored), hidden]
            self.take_checkpoints(out)
            if scores is not None:
                scored = self.model.logits(hidden[:prompt_at], upcast=False)  # [scored, V]
                kmax = max(s.k for s in scores.segments)
                prompt_lps = LogprobRows(self.model.kernels.logprob_pack(scored, targets, kmax), scores.segments)
                hidden = hidden[prompt_at:]
            if not sample_rows:
                return PendingStep([], None, self.device, started=started, prompt_logprobs=prompt_lps)
            logits = self.model.logits(hidden, fused=batch.fused_gemv, upcast=False)  # [R_s, V]
        if processing is not None and any(p.logprobs is not None for p in params):
            # Logprobs are of the processed logits (`logprobs`): processed once, here, for the draw and for them.
            logits = self.rejection.processed(logits, processing)
            processing = None
        tokens = (self.rejection.sample(logits, params, None, None, processing) if inputs is None
                  else self.rejection.decide(logits, params, inputs, processing))
        if decided is not None:
            count_decided(decided, tokens)
        return PendingStep(ids, tokens, self.device,
                           logits.float() if return_logits else None, started=started,
                           logprobs=self.output_logprobs(logits, tokens, ids, params, lp_rows),
                           prompt_logprobs=prompt_lps)

    def _pending_inputs(self, out: SchedulerOutput, prev: PendingStep | None
                        ) -> tuple[list[int], list[int], torch.Tensor] | None:
        """Where this step's PENDING input tokens come from: (flat token positions, rows of prev's tokens, prev's
        tokens), or None when every input is known. Only a decode row's one token can be PENDING (K = 0), and
        decode rows come first, so row i's token is flat token i."""
        dst: list[int] = []
        src: list[int] = []
        for i, r in enumerate(out.rows[:out.num_decodes]):
            if r.token_ids[-1] != PENDING:
                continue
            j = None if prev is None else prev.row_of(r.request_id)
            if r.num_tokens != 1 or j is None:
                raise RuntimeError(f"step: row {r.request_id!r} has a PENDING input token that no step in flight "
                                   f"samples (tokens {r.token_ids}) (a bug)")
            dst.append(i)
            src.append(j)
        return None if not dst else (dst, src, prev.tokens)

    def _graphable(self, out: SchedulerOutput) -> bool:
        """A step that a graph can run: decode rows only, each of at most the graphs' token count (a verify row
        with fewer drafts is padded)."""
        g = self.graphs
        return (g is not None and out.num_decodes == len(out.rows) and g.size_for(len(out.rows)) is not None
                and all(r.num_tokens <= g.T for r in out.rows))

    def _mixed_graphable(self, out: SchedulerOutput) -> bool:
        """A step that a mixed graph can run: decode rows of one token, each sampling, then one prompt chunk of at
        most the graphs' Q tokens, without a checkpoint row."""
        g = self.mixed_graphs
        nd = out.num_decodes
        return (g is not None and nd >= 1 and len(out.rows) == nd + 1 and not out.checkpoint_rows
                and g.size_for(nd) is not None
                and out.rows[nd].num_tokens <= g.Q and all(r.num_tokens == 1 and r.sample for r in out.rows[:nd]))

    def _mixed_graph(self, out: SchedulerOutput, fill: tuple | None = None) -> torch.Tensor:
        """Replay the mixed graph of a mixed-graphable step: the logits of its sampling rows [R_s, V] (the decode
        rows, then the chunk's when it completes its prompt)."""
        bs, nd = self.block_size, out.num_decodes
        ids: list[int] = []
        slot_mapping: list[int] = []
        seq_lens: list[int] = []
        for r in out.rows[:nd]:
            start = r.num_computed_tokens
            ids += r.token_ids
            slot_mapping += kv_slots(r.block_ids, start, start + 1, bs)
            seq_lens.append(start + 1)
        c = out.rows[nd]
        start, L = c.num_computed_tokens, c.num_tokens
        chunk = PromptChunk(ids=c.token_ids, slot_mapping=kv_slots(c.block_ids, start, start + L, bs),
                            seq_len=start + L, state_slot=c.state_slot, has_initial_state=c.has_initial_state,
                            block_table=c.block_ids)
        dec = DecodeRows(ids=ids, slot_mapping=slot_mapping, seq_lens=seq_lens,
                         state_slots=[r.state_slot for r in out.rows[:nd]],
                         block_tables=[r.block_ids for r in out.rows[:nd]])
        logits, n = self.mixed_graphs.run(dec, chunk, fill=fill)
        self.mixed_graph_steps += 1
        return torch.cat([logits[:nd], logits[n:]]) if c.sample else logits[:nd]

    def _decode_graph(self, out: SchedulerOutput, fill: tuple | None = None, **extra: list) -> torch.Tensor:
        """Replay the graph of a graphable step: logits [R, V] (decode), or the spec runner's packed results."""
        bs, T = self.block_size, self.graphs.T
        rows = out.rows
        ids: list[int] = []
        slot_mapping: list[int] = []
        seq_lens: list[int] = []
        counts: list[int] = []
        scratch = self.pools.scratch_block * bs
        # Host work here is step time the GPU waits for: one pass over the rows, no per-row copies (a row's block
        # table tuple is shared with the scheduler and only read).
        for r in rows:
            start, k = r.num_computed_tokens, len(r.token_ids)
            ids += r.token_ids
            slot_mapping += kv_slots(r.block_ids, start, start + k, bs)
            if k < T:  # a verify row with fewer drafts: padded to T, its padding writes only the scratch block
                ids += [0] * (T - k)
                slot_mapping += [scratch] * (T - k)
            seq_lens.append(start + T)
            counts.append(k)
        self.graph_steps += 1
        return self.graphs.run(
            input_ids=ids, slot_mapping=slot_mapping, seq_lens=seq_lens,
            state_slots=[r.state_slot for r in rows],
            block_tables=[r.block_ids for r in rows], num_tokens=counts if T > 1 else None, fill=fill, **extra,
        )

    def sampling_of(self, request_ids: list[str]) -> tuple[list[SamplingParams], torch.Tensor | None]:
        """The rows' SamplingParams and, where any row samples, their noise seeds on the device (`counter_noise`;
        built before the forward: a later host -> device copy would wait for the stream)."""
        params = [self._sampling[r][0] for r in request_ids]
        if all(p.greedy for p in params):
            return params, None
        return params, self._t([self._sampling[r][1] for r in request_ids])
