"""The model runner with MTP speculative decoding: verify K drafts per decode row, draft K more.

One step, all on the device until the single host read of its tokens at the end:

1. Target forward over the mixed batch. Verify rows (last token + k drafts) run the verify state ops, which
   first replay the accepted positions of the row's last verify into its state, then record the inputs of
   this step's 1+k positions (R4: no unaccepted position ever reaches the state); prefill chunks and
   first-token recomputes run the chunked scan from the row's state.
2. Logits: the last token of each prefill row that samples, every token of each verify row (R5). Prefill rows
   sample as a verify row without drafts would (`RejectionSampler.sample`, as every engine samples); verify
   rows go through the rejection sampler (greedy: accept while the target's argmax matches), whose accepted
   counts + 1 are written straight into `replay[slot]` on the device (R3): the next step replays that many
   recorded positions, whatever order its rows come in.
3. Drafter catch-up: the MTP module runs once over every token of the batch with (h_i, t_{i+1}), writing its
   own KV at every position (R8: a prefill chunk's successor token is known from the prompt; a sampling row's
   last one is the token just sampled; a verify row's are the tokens it emitted). Its output at each drafting
   row's last committed position gives draft 1.
4. Drafts 2..K: the drafter on its own output, one position further each time (its KV there is rewritten
   by step 3 of a later step once the real tokens are known).

A verify step whose rows all verify, greedy or sampling (at a temperature, with top-k / top-p), replays one CUDA
graph (`graph_step_fn`); with async scheduling the next such step can be chained on it before its results are read
(`launch_chained`: its inputs come from those results on the device, `StepGraphs.run_chained`). Rows whose logits
are processed (`logits_processing`) by penalties and min_p alone replay the graph's processed twin
(`graph_processing`: the penalised rows' counts, kept on the device per state slot, grow by the tokens each step
emits, inside the graph: `penalty_counts`), but are never chained; a step with a row that has a logit_bias, a
min_tokens not reached yet or a grammar runs eagerly, and so does a step with a row that asks for
logprobs (`logprobs`: read from the verify step's target logits at every emitted position, which the graph does not
return). Sampled rows take
their noise from their seed and token positions (`counter_noise`), prompts' first tokens included.
"""

from __future__ import annotations

import dataclasses

import torch

from baton.engine.cache_pools import CachePools
from baton.engine.causal_lm import CausalLM
from baton.engine.forward_batch import ForwardBatch
from baton.engine.graph_processing import RowProcessing, count_graph_decided, graph_inputs, graph_processable
from baton.engine.logits_processing import LogitsInputs, count_decided
from baton.engine.logprobs import LogprobRows
from baton.engine.mtp import MTPModule
from baton.engine.pending_step import PendingStep, device_mark, elapsed_seconds
from baton.engine.qwen3_5_mtp import Qwen3_5MTP
from baton.engine.rejection_sampler import RejectionSampler
from baton.engine.runner import ModelRunner, StepOutput
from baton.engine.sampling_params import SamplingParams
from baton.engine.scheduler_output import SchedulerOutput

GREEDY = SamplingParams()


@dataclasses.dataclass(frozen=True)
class VerifyFlight:
    """A whole-graph verify step queued on the device, its results not read yet."""
    request_ids: list[str]  # its rows, in order
    size: int               # the graph size it replayed (its packed results' layout)
    run: int                # its StepGraphs run number (a chained step names the run it continues)
    pending: PendingStep    # the packed results' copy to the host


class SpecRunner(ModelRunner):
    def __init__(self, model: CausalLM, mtp: MTPModule | Qwen3_5MTP, pools: CachePools, block_size: int,
                 device: torch.device | str, num_speculative_tokens: int, draft: bool = True) -> None:
        """draft=False (a prefill node): only the drafter's KV is filled, nothing is sampled or drafted."""
        super().__init__(model, pools, block_size, device)
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens: expected >= 1 for a SpecRunner, got {num_speculative_tokens}")
        self.mtp = mtp
        self.num_spec = num_speculative_tokens
        self.draft = draft
        self._mtp_kv = pools.mtp_kv_layers()
        if len(self._mtp_kv) != mtp.num_kv_layers:
            raise ValueError(f"cache pools: expected {mtp.num_kv_layers} MTP KV layers, got {len(self._mtp_kv)}")
        self.rejection = RejectionSampler(num_speculative_tokens, model.kernels, model.tp)
        # The last eager step's start mark (`pending_step.device_mark`): a prefill-only launch's PendingStep times
        # from it.
        self._started: torch.cuda.Event | None = None
        # The last eager step's prompt logprob rows: a prefill-only launch's PendingStep carries them.
        self._prompt_rows: LogprobRows | None = None

    def launch(self, out: SchedulerOutput, prev: PendingStep | None = None,
               return_logits: bool = False) -> PendingStep:
        """A prefill node's step (draft=False: it never samples), queued without a host read. A drafting runner's
        steps go through `execute`, or `launch_verify` / `launch_chained` / `read_verify` for whole-graph verify steps:
        how many tokens a verify row commits is known only once its tokens are read (or on the device)."""
        if self.draft:
            raise RuntimeError("SpecRunner.launch: expected a prefill-only runner (draft=False); a drafting runner "
                               "runs its steps with execute()")
        self._started = self._prompt_rows = None
        if self.execute(out, return_logits).sampled:
            raise RuntimeError("SpecRunner.launch: a prefill-only step sampled (a bug)")
        return PendingStep([], None, self.device, started=self._started, prompt_logprobs=self._prompt_rows)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, return_logits: bool = False) -> StepOutput:
        if return_logits:
            raise ValueError("return_logits: not available with speculative decoding")
        if not out.rows:
            return StepOutput(sampled={})
        if self._whole_step_graphable(out):
            return self._graph_step(out)
        self.restore_checkpoints(out)
        input_ids, batch = self.build_batch(out, spec=True)
        dev, rows, nd = self.device, out.rows, out.num_decodes
        # Every host-derived tensor is built before the forward: a host -> device copy from pageable memory
        # waits for the stream, so building one later in the step would be a hidden sync.
        next_ids = self._t(self._successors(rows))  # [T]
        prefill_sampling = [i for i in range(nd, len(rows)) if rows[i].sample]
        ends = [r.num_computed_tokens + r.num_tokens for r in rows]
        scores = self.prompt_scores(out)
        scored = None if scores is None else (self._t(scores.flat), self._t(scores.targets))
        if nd:
            num_draft = self._t([r.num_draft for r in rows[:nd]])  # [Rd]
            verify_base = self._t([r.num_computed_tokens for r in rows[:nd]])  # [Rd] position of the last token
            verify_ids = [r.request_id for r in rows[:nd]]
            params, seeds = self.sampling_of(verify_ids)
            Tv = max(r.num_tokens for r in rows[:nd])
            processing = self.processing_of(verify_ids, params, [r.state_slot for r in rows[:nd]],
                                            [r.token_ids[1:] for r in rows[:nd]], Tv)
            lp = (verify_ids, self.logprob_rows(params, per_row=Tv)) if self.wants_logprobs(verify_ids) else None
        if prefill_sampling:
            starts = out.token_starts
            last = self._t([starts[i + 1] - 1 for i in prefill_sampling])  # [P] flat index of each last token
            last_pos = self._t([ends[i] - 1 for i in prefill_sampling])   # [P] its position
            prefill_rows = self._t(prefill_sampling)
            p_ids = [rows[i].request_id for i in prefill_sampling]
            p_params, p_seeds = self.sampling_of(p_ids)
            p_processing = self.processing_of(p_ids, p_params, [rows[i].state_slot for i in prefill_sampling])
            p_lp_rows = self.logprob_rows(p_params)

        started = self._started = device_mark(self.device)  # the step's start (`StepOutput.device_seconds`)
        hidden = self.model(input_ids, batch)  # [T, hidden]
        self.take_checkpoints(out)

        pieces: list[torch.Tensor] = []  # flattened int64 results, read back once at the end
        anchors, anchor_pos, anchor_rows = [], [], []
        logprob_rows: list[LogprobRows] = []
        if scores is not None:
            scored_logits = self.model.logits(hidden[scored[0]], upcast=False)
            self._prompt_rows = LogprobRows(
                self.model.kernels.logprob_pack(scored_logits, scored[1], max(s.k for s in scores.segments)),
                scores.segments)
        if nd:
            got, anchor, pos, verify_lp = self._verify(hidden, input_ids, batch, next_ids, num_draft, verify_base,
                                                       params, seeds, processing=processing, lp=lp)
            pieces += got
            if processing is not None:  # the emitted tokens: accepted drafts and the sampled one, then -1
                count_decided(processing, got[1].view(nd, -1))
            if verify_lp is not None:
                logprob_rows.append(verify_lp)
            anchors.append(anchor)
            anchor_pos.append(pos)
            anchor_rows.append(torch.arange(nd, device=dev))

        # -- prefill rows that sample ----------------------------------------------------------------------
        if prefill_sampling:
            # The token after each prompt: drawn as a verify row without drafts draws it (at position last_pos + 1),
            # as every engine samples, so that a transferred request's first decode step (a verify row of token N,
            # R1) samples what the aggregated engine's last prefill chunk does (R6).
            p_logits = self.model.logits(hidden[last], upcast=False)  # [P, V]
            p_decided = p_processing
            if p_processing is not None and any(p.logprobs is not None for p in p_params):
                # Logprobs are of the processed logits (`logprobs`): processed once, for the draw and for them.
                p_logits, p_processing = self.rejection.processed(p_logits, p_processing), None
            tokens = self.rejection.sample(p_logits, p_params, p_seeds, None if p_seeds is None else last_pos + 1,
                                           p_processing)
            if p_decided is not None:
                count_decided(p_decided, tokens)
            p_lp = self.output_logprobs(p_logits, tokens, p_ids, p_params, p_lp_rows)
            if p_lp is not None:
                logprob_rows.append(p_lp)
            next_ids[last] = tokens
            pieces.append(tokens)
            anchors.append(last)
            anchor_pos.append(last_pos)
            anchor_rows.append(prefill_rows)

        # -- the drafter: catch up over every position (fills its KV, R8), then K drafts per sampling row ---
        drafting = self.draft and bool(anchors)
        h, mtp_batch = self._catch_up(hidden, next_ids, batch, torch.cat(anchors) if drafting else self._no_tokens)
        drafts_out = None
        if drafting:
            tables = batch.block_tables[torch.cat(anchor_rows)]  # [D, max_blocks]
            drafts_out = self._chain(h, mtp_batch, torch.cat(anchor_pos), tables)
            pieces.append(drafts_out.reshape(-1))

        prompt_lps = {} if self._prompt_rows is None or scores is None else self._prompt_rows.read()
        if not pieces:
            return StepOutput(sampled={}, prompt_logprobs=prompt_lps)
        ended = None if started is None else device_mark(self.device)
        host = torch.cat(pieces).tolist()  # the one device -> host read of the step
        result = self._unpack(host, out, prefill_sampling, drafts_out is not None,
                              seconds=elapsed_seconds(started, ended))
        for rows_lp in logprob_rows:
            result.logprobs.update(rows_lp.read())
        result.prompt_logprobs.update(prompt_lps)
        return result

    @staticmethod
    def _successors(rows, width: int = 0) -> list[int]:
        """The successor token of every position, for the drafter: the host-known ones (a verify row's
        are overwritten on the device by the tokens it emits); with `width`, each row padded to that many."""
        nxt: list[int] = []
        for r in rows:
            nxt.extend(r.token_ids[1:])
            nxt.append(max(r.next_token, 0))
            nxt.extend([0] * (width - len(r.token_ids)))
        return nxt

    def _verify(self, hidden: torch.Tensor, input_ids: torch.Tensor, batch: ForwardBatch, next_ids: torch.Tensor,
                num_draft: torch.Tensor, verify_base: torch.Tensor, params: list, seeds: torch.Tensor | None,
                sampling: tuple[torch.Tensor, ...] | None = None, processing: LogitsInputs | None = None,
                lp: tuple[list[str], torch.Tensor | None] | None = None
                ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, LogprobRows | None]:
        """The verify rows (the batch's first Rd): rejection sampling, R3's replay counts, and the emitted
        tokens written into `next_ids` as the drafter's successors. `sampling` (a graph's rows that sample): the
        rows' (temperature, seeds) tensors, with top-k / top-p ones (temperature, seeds, top_k, top_p), which
        `params` / `seeds` then stand aside for; `processing`: the rows' logits processing (eager steps only).
        `lp` (eager steps whose rows ask for logprobs): the rows' request ids and `logprob_rows` (per_row = Tv).
        Returns (the results to read back: emitted counts [Rd] and tokens [Rd*Tv], the flat token of each row's last
        committed position [Rd], its position [Rd], the logprobs of every position of the rows that asked: the
        target's, of the processed logits, at the token each position emits)."""
        nd = batch.num_decodes
        idx = batch.spec_token_index  # [Rd, Tv]
        Tv = idx.shape[1]
        uniform = batch.spec_uniform  # (row, t) is token row * Tv + t: views, no gathers
        rows_hidden = hidden[:nd * Tv] if uniform else hidden[idx.reshape(-1)]
        logits = self.model.logits(rows_hidden, upcast=False).view(nd, Tv, -1)  # [Rd, Tv, V]
        # [Rd, Tv-1]; padding positions are masked by num_draft
        drafts = input_ids[:nd * Tv].view(nd, Tv)[:, 1:] if uniform else input_ids[idx[:, 1:]]
        if processing is not None and (lp is not None or sampling is not None):
            # Logprobs are of the processed logits (`logprobs`): processed once, for the verify and for them; a
            # graph's sampling rows are decided from device tensors alone, on the processed logits.
            logits, processing = self.model.kernels.process_logits(logits, drafts, num_draft, processing), None
        # Column t of a row decides the token at position verify_base + 1 + t.
        if sampling is not None:
            res = self.rejection.verify_tempered(logits, drafts, num_draft, *sampling[:2], verify_base + 1,
                                                 *sampling[2:])
        else:
            res = self.rejection.verify(logits, drafts, None, num_draft, params, seeds,
                                        None if seeds is None else verify_base + 1, processing)
        # R3: the device decides how far each row's state advances (its last token + the accepted drafts).
        self.replay[batch.state_slots[:nd]] = res.accepted_counts + 1
        emitted = res.output_token_ids  # [Rd, Tv]: accepted drafts, the sampled token, then -1
        # The drafter sees the emitted tokens as successors at the positions they follow.
        successors = emitted.clamp_min(0).reshape(-1)
        next_ids[:batch.num_decode_tokens] = successors if uniform else successors[batch.spec_flat_index]
        anchor = batch.query_start_loc[:nd] + res.accepted_counts
        rows_lp = None
        if lp is not None:
            # Position t of a row scores the token it emits there (the accepted draft t, or the sampled one); the
            # positions past those are read back too and dropped on the host.
            rows_lp = self.output_logprobs(logits.reshape(nd * Tv, -1), successors, lp[0], params, lp[1], per_row=Tv)
        return [res.num_emitted, emitted.reshape(-1)], anchor, verify_base + res.accepted_counts, rows_lp

    def _catch_up(self, hidden: torch.Tensor, next_ids: torch.Tensor, batch: ForwardBatch, anchor: torch.Tensor
                  ) -> tuple[torch.Tensor, ForwardBatch]:
        """The drafter over every position of the batch with (h_i, t_{i+1}): fills its KV (R8). Returns its output
        at the drafting rows' anchors [D, hidden] (their last accepted position: where draft 1 comes from; the
        drafter's layers past its attention run on those alone) and its batch."""
        mtp_batch = self.mtp.with_kv_caches(batch, self._mtp_kv)
        return self.mtp(hidden, next_ids, self.model.input_embeddings(), mtp_batch, step=0, keep=anchor), mtp_batch

    def _chain(self, h: torch.Tensor, mtp_batch: ForwardBatch, pos: torch.Tensor, tables: torch.Tensor
               ) -> torch.Tensor:
        """K drafts per drafting row: draft 1 from the catch-up's output at the row's anchor (h [D, hidden]), then
        the drafter on its own output, one position further each time. Returns [D, K]."""
        emb = self.model.input_embeddings()
        tok = self.model.logits(h, upcast=False).argmax(dim=-1)  # [D] draft 1
        chain = [tok]
        for k in range(1, self.num_spec):
            h = self.mtp(h, tok, emb, self._draft_batch(mtp_batch, tables, pos + k), step=k)
            tok = self.model.logits(h, upcast=False).argmax(dim=-1)
            chain.append(tok)
        return torch.stack(chain, dim=1)

    # ---- the whole verify step as one CUDA graph --------------------------------------------------------
    def _whole_step_graphable(self, out: SchedulerOutput) -> bool:
        """Verify rows only, each with at most K drafts (padded to K), drafting: the step is a fixed sequence of
        device ops, so a graph holds all of it (`StepGraphs`' greedy, tempered or filtered variant)."""
        ids = [r.request_id for r in out.rows]
        return self.draft and self._graphable(out) and self.graph_processes(ids) and not self.wants_logprobs(ids)

    def graph_processes(self, request_ids: list[str]) -> bool:
        """Whether the rows' logits processing, if any, is what a verify graph holds (`graph_processing`)."""
        return all(graph_processable(self._sampling[r][0], self._history.get(r)) for r in request_ids)

    def _row_processing(self, out: SchedulerOutput) -> RowProcessing | None:
        """A graph step's processing inputs (None: no row is processed); the penalty tables made where they are not
        yet, and a penalised row's counts set from its history where its slot holds another request's, as an eager
        step's `processing_of` does."""
        rows = out.rows
        ids = [r.request_id for r in rows]
        if not self.processes(ids):
            return None
        params = [self._sampling[r][0] for r in ids]
        slots = [r.state_slot for r in rows]
        self.resident_counts(ids, params, slots, allocate=True)
        # The tables' zero row is one past the plan's slots: the scratch slot's index, as padding rows read it.
        return RowProcessing.of(params, slots, self.pools.scratch_slot)

    def _row_sampling(self, request_ids: list[str]) -> dict[str, list]:
        """A graph step's per-row temperatures, noise seeds (0 for greedy rows), top-k and top-p, as
        `StepGraphs.run` takes them; none when every row is greedy (its graph reads none)."""
        rows = [self._sampling[rid] for rid in request_ids]
        if all(params.greedy for params, _ in rows):
            return {}
        temperature, seeds, top_k, top_p = [], [], [], []
        for params, seed in rows:
            temperature.append(params.temperature)
            seeds.append(0 if params.greedy else seed)
            top_k.append(params.top_k)
            top_p.append(params.top_p)
        return {"temperature": temperature, "seeds": seeds, "top_k": top_k, "top_p": top_p}

    def graph_step_fn(self, input_ids: torch.Tensor, batch: ForwardBatch, next_ids: torch.Tensor,
                      verify_base: torch.Tensor, sampling: tuple[torch.Tensor, ...] | None = None,
                      processing: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        """What the step graph captures: forward, verify, drafter catch-up and chain, for n verify rows of 1+K
        tokens (a row's real count, 1 + its drafts, is the per-row input `spec_num_tokens`; the rest is
        padding); sampling: None for greedy rows only, else the rows' (temperature, seeds[, top_k, top_p])
        tensors; processing: None, or the rows' (presence, frequency, repetition, min_p, temperature, penalty-table
        rows) tensors (`graph_processing`). Returns the packed results [n (emitted counts) + n*T (emitted) + n*K
        (drafts)]."""
        n = batch.num_decodes
        hidden = self.model(input_ids, batch)
        num_draft = batch.spec_num_tokens - 1
        inputs = None
        if processing is not None:
            tables = self.penalties
            assert tables.counts is not None and tables.prompt_bits is not None  # (`_row_processing` made them)
            inputs = graph_inputs(*processing, tables.counts, tables.prompt_bits)
        pieces, anchor, pos, _ = self._verify(hidden, input_ids, batch, next_ids, num_draft, verify_base,
                                              [GREEDY] * n, None, sampling, processing=inputs)
        if inputs is not None:
            count_graph_decided(inputs, pieces[1].view(n, -1), self.pools.scratch_slot)
        h, mtp_batch = self._catch_up(hidden, next_ids, batch, anchor)
        drafts = self._chain(h, mtp_batch, pos, batch.block_tables)
        return torch.cat([*pieces, drafts.reshape(-1)])

    def _graph_step(self, out: SchedulerOutput) -> StepOutput:
        return self.read_verify(self.launch_verify(out))

    def verify_graphable(self, out: SchedulerOutput) -> bool:
        """Whether `launch_verify` can run the step: the whole verify step replays a graph."""
        return bool(out.rows) and self._whole_step_graphable(out)

    def launch_verify(self, out: SchedulerOutput) -> VerifyFlight:
        """Queue a whole verify step's graph (`verify_graphable`) and return at once; `read_verify` waits for its
        results."""
        rows = out.rows
        T = 1 + self.num_spec
        ids = [r.request_id for r in rows]
        packed = self._decode_graph(out, next_ids=self._successors(rows, T),
                                    verify_base=[r.num_computed_tokens for r in rows], **self._row_sampling(ids),
                                    processing=self._row_processing(out))
        return self._flight(ids, packed)

    def launch_chained(self, prev: VerifyFlight, request_ids: list[str], state_slots: list[int], rooms: list[int],
                       block_tables: list[list[int]]) -> VerifyFlight:
        """Queue the verify step after `prev` (the last one launched, its results maybe not read yet) for these
        of its requests: their inputs come from prev's results on the device (`StepGraphs.run_chained`, where
        `rooms` is explained). The caller guarantees that each row's next step is exactly that and that
        `block_tables` cover its worst case (`Scheduler.chain`)."""
        row = {rid: i for i, rid in enumerate(prev.request_ids)}
        src = [row[rid] for rid in request_ids]
        packed = self.graphs.run_chained(prev.run, src, state_slots, rooms, block_tables,
                                         **self._row_sampling(request_ids))
        self.graph_steps += 1
        return self._flight(list(request_ids), packed)

    def _flight(self, request_ids: list[str], packed: torch.Tensor) -> VerifyFlight:
        g = self.graphs
        # PendingStep copies the packed results to pinned memory behind the graph and marks the step's end.
        pending = PendingStep([], packed, self.device, started=g.started)
        return VerifyFlight(request_ids=request_ids, size=g.size_for(len(request_ids)), run=g.runs, pending=pending)

    def read_verify(self, flight: VerifyFlight) -> StepOutput:
        """Wait for a launched verify step (not for steps launched after it): per request, its emitted tokens and
        its next K drafts."""
        flat = flight.pending.values()  # the one device -> host read of the step
        n, T, K = flight.size, 1 + self.num_spec, self.num_spec
        sampled: dict[str, list[int]] = {}
        drafts: dict[str, list[int]] = {}
        at = n + n * T
        for b, rid in enumerate(flight.request_ids):
            sampled[rid] = flat[n + b * T:n + b * T + flat[b]]
            drafts[rid] = flat[at + b * K:at + (b + 1) * K]
        return StepOutput(sampled=sampled, drafts=drafts, device_seconds=flight.pending.device_seconds())

    def _draft_batch(self, batch: ForwardBatch, tables: torch.Tensor, pos: torch.Tensor) -> ForwardBatch:
        """One drafter token per drafting row at positions `pos` [D] (computed on the device)."""
        bs, d = self.block_size, pos.shape[0]
        slot = tables.gather(1, (pos // bs)[:, None]).squeeze(1) * bs + pos % bs  # [D]
        return dataclasses.replace(
            batch, num_decodes=0, num_decode_tokens=0,
            query_start_loc=torch.arange(d + 1, device=self.device), seq_lens=pos + 1, block_tables=tables,
            slot_mapping=slot, spec_num_tokens=None, spec_replay=None, spec_token_index=None,
            spec_flat_index=None, verify_inputs=None, prefill_chunk_meta=None, attention_meta=None)

    def _unpack(self, host: list[int], out: SchedulerOutput, prefill_sampling: list[int],
                drafted: bool, width: int = 0, seconds: float = 0.0) -> StepOutput:
        """Per request, its emitted tokens and next drafts from the step's one read; `width`: the verify rows'
        padded token count (a graph's T), else their longest."""
        rows, nd = out.rows, out.num_decodes
        sampled: dict[str, list[int]] = {}
        drafts: dict[str, list[int]] = {}
        at = 0
        order: list[str] = []
        if nd:
            Tv = width or max(r.num_tokens for r in rows[:nd])
            counts = host[:nd]
            emitted = host[nd:nd + nd * Tv]
            at = nd + nd * Tv
            for b, r in enumerate(rows[:nd]):
                sampled[r.request_id] = emitted[b * Tv:b * Tv + counts[b]]
                order.append(r.request_id)
        for i in prefill_sampling:
            sampled[rows[i].request_id] = [host[at]]
            order.append(rows[i].request_id)
            at += 1
        if drafted:
            K = self.num_spec
            for j, rid in enumerate(order):
                drafts[rid] = host[at + j * K:at + (j + 1) * K]
        return StepOutput(sampled=sampled, drafts=drafts, device_seconds=seconds)
