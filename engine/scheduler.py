"""Token-budget scheduler: decode rows first, chunked prefills share the rest, FCFS admission.

Invariants: works on ints only (token counts; block and slot ids through its `CacheManager`); decides what runs
each step and nothing else (a step's effect on its requests is `StepUpdate`'s); `waiting` and `running` are in
arrival order, every unfinished request is in exactly one of them and in `requests`.

Per step (R5):
1. every running request in its decode phase gets its 1+k tokens reserved first (its last token and the k
   drafts to verify, k <= K with speculative decoding), with the KV blocks it needs;
   when blocks run out, the latest-arrived running request is preempted (recompute: its blocks and slot
   are freed, it goes back to the front of the queue and later prefills prompt + outputs again);
2. running requests still prefilling get a chunk each: min(remaining, budget left, chunk cap);
3. waiting requests are admitted in arrival order while budget, sequence slots, state slots and KV
   blocks last; the first that does not fit stops admission (no overtaking).
With `mixed_graph_tokens` = Q and decode rows in the step, 2 and 3 give one prompt chunk at most, of at most Q
tokens (such a step replays a CUDA graph: `mixed_graphs.py`).

With the prefix cache (`prefix_cache.py`), an admitted request starts after the longest cached prefix of its prompt
that ends on a state checkpoint (its blocks held, the checkpoint copied into its slot before the step), at most all
of its prefill tokens but one: every request computes at least one token, so that its logits (or, prefill-only,
its handed-over state) come from a step. Of the checkpoint boundaries a prefill chunk reaches that the cache lacks,
the last is taken: where the chunk ends on it, its state is copied into a checkpoint slot after the step; else the
step runs a checkpoint row (`CheckpointRow`: the chunk's tokens up to it once more in the recurrent mixers, into a
lent state slot copied after the step). An engine with mixed graphs, or one with no state slot to lend, cuts the
chunk at that boundary instead; no other chunk is cut.

With async scheduling a request that stops on step n's token was already scheduled into step n+1: that row's work
is dropped (`StepUpdate`). A verify step may be chained on one not read yet (`chain`): the next step is then what
`schedule()` would give once that one is read.
"""

from __future__ import annotations

from collections import deque

from baton.engine.cache_manager import CacheManager
from baton.engine.engine_config import EngineConfig
from baton.engine.prefix_cache import PrefixCache
from baton.engine.request import Request, RequestStatus
from baton.engine.scheduler_output import CheckpointRow, ScheduledRow, SchedulerOutput, new_row


class Scheduler:
    def __init__(self, config: EngineConfig, num_blocks: int, num_slots: int, num_checkpoints: int = 0,
                 prefix_seed: bytes = b"") -> None:
        """num_slots: state slots (one per request that holds a state); num_checkpoints: the prefix cache's
        checkpoint slots (0: no prefix cache); prefix_seed: the model's identity, which seeds its hashes."""
        self.config = config
        self.num_spec = 0 if config.prefill_only else config.num_speculative_tokens
        # A row that samples then drafts K tokens, writing the drafter's KV up to K-1 positions ahead.
        self.lookahead = max(0, self.num_spec - 1)
        self.cache = CacheManager(config.block_size, num_blocks, num_slots)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # ordered by arrival
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.prefix = (PrefixCache(self.cache.blocks, config.block_size, num_checkpoints,
                                   config.prefix_checkpoint_stride, prefix_seed,
                                   match_successor=config.num_speculative_tokens > 0)
                       if config.enable_prefix_caching and num_checkpoints else None)

    # ---- queue management -----------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self._check_new(req)
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def _check_new(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id: expected a new id, got duplicate {req.request_id!r}")
        # A request that could not run even alone would wait (or preempt itself) forever.
        longest = min(req.num_tokens + req.sampling.max_tokens, req.max_model_len) + self.num_spec
        capacity, block_size = self.cache.blocks.capacity, self.cache.block_size
        if -(-longest // block_size) > capacity:
            raise ValueError(f"request length: expected at most {capacity * block_size} tokens "
                             f"(the whole KV pool), got prompt + max_tokens (+ K drafts) = {longest}")

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        self.finish(req, RequestStatus.FINISHED_ABORTED)
        return req

    def abort_prefilled(self, req: Request) -> None:
        """Abort a prefill-only request that finished but was not handed over yet: its held caches go back (after
        the step in flight that wrote them)."""
        if req.status is not RequestStatus.FINISHED_PREFILLED:
            raise ValueError(f"abort_prefilled: expected a prefilled request, got {req.status.value!r} for "
                             f"{req.request_id!r}")
        req.status = RequestStatus.FINISHED_ABORTED
        self.cache.release(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ---------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        cap = self.config.prefill_chunk_cap
        preempted: list[str] = []
        planned: dict[str, int] = {}  # request id -> tokens this step
        restores: list[tuple[int, int]] = []
        checkpoints: list[tuple[int, int]] = []
        inside_rows: list[CheckpointRow] = []
        if self.prefix is not None:
            self.prefix.begin_step()

        # 1. decode rows: reserved first, 1 + k tokens each (k drafts to verify).
        decoding: list[Request] = []  # in arrival order
        for req in list(self.running):
            if req.status is not RequestStatus.RUNNING or not req.in_decode:
                continue
            n = 1 + self._num_draft(req)
            if self._reserve(req, n, planned, preempted, self.lookahead):
                planned[req.request_id] = n
                decoding.append(req)
                budget -= n
        # One prompt chunk of at most Q tokens beside decode rows (EngineConfig.mixed_graph_tokens).
        one_chunk = bool(self.config.mixed_graph_tokens and decoding)
        if one_chunk:
            cap = min(cap, self.config.mixed_graph_tokens)
        # Checkpoints inside a chunk need extra mixer rows, which a mixed graph's fixed shapes cannot take. An engine
        # with mixed graphs cuts chunks at boundaries in every step: a burst of prompts then stays in prefill, where
        # a step admits them all, rather than one per step beside the first request's decode row.
        inside = not self.config.mixed_graph_tokens

        # 2. running prefills (chunked). Every planned request is running (victims are never planned ones): when
        # all running requests are planned, none is left to prefill.
        for req in (list(self.running) if len(planned) < len(self.running) else ()):
            if budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING or req.in_decode or req.request_id in planned:
                continue
            n = self._cut(req, min(req.num_prefill_tokens - req.num_computed_tokens, budget, cap), inside)
            n = self.cache.fit(req, n)
            if n == 0 and self._reserve(req, 1, planned, preempted):
                n = self.cache.fit(req, self._cut(req, min(req.num_prefill_tokens - req.num_computed_tokens, budget,
                                                           cap), inside))
            # The last chunk samples and drafts, writing the drafter's KV up to K-1 positions ahead: it needs
            # that room too (preempting later arrivals, or itself, as a decode row would).
            if (n > 0 and self._last_chunk(req, n) and self.lookahead
                    and not self._reserve(req, n, planned, preempted, self.lookahead)):
                continue
            if n > 0:
                self.cache.allocate_for(req, n)
                planned[req.request_id] = n
                budget = 0 if one_chunk else budget - n
                self._checkpoint(req, n, checkpoints, inside_rows, inside)

        # 3. admission, FCFS; none in a step that had to preempt (it would only thrash). A request is
        # admitted only if the blocks for its whole prefill are free now, not just for its first chunk.
        free_blocks = self.cache.blocks.num_free
        while (self.waiting and budget > 0 and not preempted and len(self.running) < self.config.max_num_seqs
               and self.cache.slots.can_allocate(1)):
            req = self.waiting[0]
            # A prefill-only request computes all but its last prompt token (R1: decode computes token N).
            prefill = req.num_tokens - 1 if req.prefill_only else req.num_tokens
            # A request scoring its prompt (prompt_logprobs) computes every position: a cached prefix has no logits.
            hit = (None if self.prefix is None or req.prompt_logprobs is not None
                   else self.prefix.lookup(req, prefill - 1))
            whole = -(-(req.num_tokens + self.lookahead) // self.cache.block_size)
            if hit is not None:
                whole += self.prefix.reclaimable_in(hit) - len(hit.block_ids)
            if whole > free_blocks:
                break
            free_blocks -= whole
            req.num_prefill_tokens = prefill
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = 0
            self.cache.assign_slot(req)
            if self.prefix is not None:
                self.prefix.queried_tokens += prefill
            if hit is not None:
                self.prefix.use(hit, req)
                req.set_blocks(list(hit.block_ids))
                req.num_computed_tokens = hit.num_tokens
                restores.append((hit.checkpoint, req.state_slot))
            n = self._cut(req, min(prefill - req.num_computed_tokens, budget, cap), inside)
            self.cache.allocate_for(req, n, self.lookahead if self._last_chunk(req, n) else 0)
            self._insert_running(req)
            planned[req.request_id] = n
            budget = 0 if one_chunk else budget - n
            self._checkpoint(req, n, checkpoints, inside_rows, inside)

        # Decodes first, each group in arrival order. A decode row stays in `running` (only unplanned requests are
        # preempted, and a prefill or admission never turns a request into a decode within the step).
        rows = [self._decode_row(req, planned[req.request_id]) for req in decoding]
        if len(planned) > len(decoding):
            rows += [self._prefill_row(req, planned[req.request_id]) for req in self.running
                     if req.request_id in planned and not req.in_decode]
        return SchedulerOutput(rows=tuple(rows), preempted=tuple(preempted), restores=tuple(restores),
                               checkpoints=tuple(checkpoints), checkpoint_rows=tuple(inside_rows))

    def chain(self, out: SchedulerOutput) -> list[tuple[str, int, int, tuple[int, ...]]] | None:
        """Chain a verify step on `out`, launched and not read yet (async scheduling with drafts, a whole-graph
        step): the next step is then `out`'s requests again, each verifying the drafts that `out` makes: K, or fewer
        as `_num_draft` gives near a length limit once `out`'s emitted count is known (the device computes it from a
        row's room). Only when that is what `schedule()` would give after reading `out` for every request that does
        not finish there: no request waits or prefills, and the running ones are exactly `out`'s rows, in order (the
        caller leaves out rows of requests aborted since). Allocates the blocks of the worst case (every draft of
        `out` accepted, the next step's 1+K tokens and the drafter's lookahead); None (nothing allocated) where any
        of that fails. Returns each row's (request id, state slot, room: the outputs it may still emit minus one,
        block table); `chained_output` gives the step's rows once `out` is read."""
        if not self.num_spec or not out.rows or self.waiting or len(self.running) != len(out.rows):
            return None
        need: list[int] = []
        for row, req in zip(out.rows, self.running, strict=True):
            if row.request_id != req.request_id or not row.is_decode or req.status is not RequestStatus.RUNNING:
                return None
            need.append(self.cache.blocks_needed(req, row.num_tokens + 1 + self.num_spec, self.lookahead))
        if not self.cache.blocks.can_allocate(sum(need)):
            return None
        for req, b in zip(self.running, need, strict=True):
            self.cache.grow(req, b)
        return [(req.request_id, req.state_slot, req.output_limit - len(req.output_token_ids) - 1,
                 req.block_table()) for req in self.running]

    def chained_output(self, request_ids: list[str]) -> SchedulerOutput:
        """The rows of a step chained by `chain` (its requests in launch order), once the step before it is read
        and updated: a request that finished there has no row (its row's work is dropped)."""
        rows = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue
            if not req.in_decode or len(req.draft_token_ids) != self.num_spec:
                raise RuntimeError(f"chained step: expected {rid!r} in decode with {self.num_spec} drafts, got "
                                   f"{len(req.draft_token_ids)} (a bug)")
            rows.append(self._decode_row(req, 1 + self._num_draft(req)))
        return SchedulerOutput(rows=tuple(rows), preempted=())

    # ---- helpers ----------------------------------------------------------------------------------
    def _num_draft(self, req: Request) -> int:
        """Drafts to verify this step: at most K, and none past max_tokens or max_model_len."""
        if not req.draft_token_ids:
            return 0
        room = req.output_limit - len(req.output_token_ids) - 1
        return max(0, min(len(req.draft_token_ids), self.num_spec, room))

    def _last_boundary(self, req: Request, n: int) -> int:
        """The last checkpoint boundary req's chunk of n tokens reaches (one with a known next token, within the
        prefill), or 0 where it reaches none past its start."""
        s = self.prefix.stride_tokens
        start = req.num_computed_tokens
        last = min(start + n, req.num_prefill_tokens, req.num_tokens - 1) // s * s
        return last if last > start else 0

    def _can_lend(self) -> bool:
        """A state slot can be lent to the step for a checkpoint inside a chunk, one being kept for the next request
        waiting."""
        return self.cache.slots.num_free > (1 if self.waiting else 0)

    def _cut(self, req: Request, n: int, inside: bool) -> int:
        """n, or less so that the chunk ends on the last checkpoint boundary it reaches that the prefix cache lacks,
        unless the step can take that checkpoint inside the chunk (`inside` and a slot to lend)."""
        pc = self.prefix
        if pc is None or n <= 0:
            return n
        last = self._last_boundary(req, n)
        if not last or last == req.num_computed_tokens + n or not pc.missing(req, last):
            return n
        return n if inside and self._can_lend() else last - req.num_computed_tokens

    def _checkpoint(self, req: Request, n: int, checkpoints: list[tuple[int, int]],
                    inside_rows: list[CheckpointRow], inside: bool) -> None:
        """Where req's chunk of n tokens reaches a checkpoint boundary the cache lacks: cache its blocks up to the
        last such boundary and plan its state there into a checkpoint slot: the row's own state after the step where
        the chunk ends on it, else (`inside` and a slot to lend) a lent slot's that the mixers run the chunk's tokens
        up to it into (`CheckpointRow`)."""
        pc = self.prefix
        if pc is None:
            return
        last = self._last_boundary(req, n)
        start = req.num_computed_tokens
        if not last or not pc.missing(req, last) or (last < start + n and not (inside and self._can_lend())):
            return
        slot = pc.take(req, last)
        assert slot is not None and req.state_slot is not None
        if last == start + n:
            checkpoints.append((req.state_slot, slot))
            return
        lent = self.cache.lend_slot()
        inside_rows.append(CheckpointRow(req.request_id, last - start, lent))
        checkpoints.append((lent, slot))

    def _last_chunk(self, req: Request, n: int) -> bool:
        return req.num_computed_tokens + n == req.num_tokens and not req.prefill_only

    def _decode_row(self, req: Request, n: int) -> ScheduledRow:
        """The last token and n - 1 drafts to verify; a decode row always samples."""
        assert req.state_slot is not None
        k = n - 1
        return new_row(
            request_id=req.request_id,
            token_ids=(req.last_token_id, *req.draft_token_ids[:k]) if k else (req.last_token_id,),
            num_computed_tokens=req.num_computed_tokens,
            is_decode=True,
            has_initial_state=req.num_computed_tokens > 0,
            state_slot=req.state_slot,
            block_ids=req.block_table(),
            sample=True,
            num_draft=k,
            next_token=-1,
        )

    def _prefill_row(self, req: Request, n: int) -> ScheduledRow:
        """A chunk of n tokens; the last chunk samples (unless prefill-only)."""
        start = req.num_computed_tokens
        assert req.state_slot is not None
        end, total = start + n, req.num_tokens
        return ScheduledRow(
            request_id=req.request_id,
            token_ids=tuple(req.token_ids_between(start, end)),
            num_computed_tokens=start,
            is_decode=False,
            has_initial_state=req.has_initial_state,
            state_slot=req.state_slot,
            block_ids=req.block_table(),
            sample=end == total and not req.prefill_only,
            next_token=req.token_ids_between(end, end + 1)[0] if end < total else -1,
        )

    def _reserve(self, req: Request, n: int, planned: dict[str, int], preempted: list[str],
                 lookahead: int = 0) -> bool:
        """Make room for n tokens of req (plus lookahead positions), preempting the latest-arrived unplanned
        running requests. Returns False when req itself had to be preempted.
        """
        # Preempting others does not change what req needs: count it once.
        need = self.cache.blocks_needed(req, n, lookahead)
        while not self.cache.blocks.can_allocate(need):
            # Lowest priority = latest arrival among those not yet given tokens this step (maybe req).
            victim = [r for r in self.running if r.request_id not in planned][-1]
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is req:
                return False
        # Most decode steps stay inside the last block: nothing to allocate.
        self.cache.grow(req, need)
        return True

    def _preempt(self, req: Request) -> None:
        self.cache.release(req)
        self.running.remove(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.draft_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        # Back to the front, keeping arrival order among preempted requests.
        idx = 0
        while idx < len(self.waiting) and self.waiting[idx].arrival < req.arrival:
            idx += 1
        self.waiting.insert(idx, req)

    def _insert_running(self, req: Request) -> None:
        idx = len(self.running)
        while idx > 0 and self.running[idx - 1].arrival > req.arrival:
            idx -= 1
        self.running.insert(idx, req)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Take req out of the queues with `status`; its caches go back unless it hands them over (prefilled)."""
        if req.status.finished:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if status is not RequestStatus.FINISHED_PREFILLED:
            self.cache.release(req)
        req.status = status
        del self.requests[req.request_id]

    def add_computed(self, req: Request, block_ids: list[int], state_slot: int, num_computed: int) -> None:
        """Admit a request whose first `num_computed` tokens are already in the given blocks and slot
        (transferred from a prefill node). Its next step computes token num_computed + 1 from that state.

        With N-1 of N tokens computed (R1), that step is a decode row: token N from the transferred h(N-1) (R2:
        the request has its state), so it joins the decode batch (and its CUDA graph; with K > 0 a verify row
        without drafts, padded in the graph) instead of making the step a mixed, eager one. With K > 0 a sampled
        token N is drawn there as the aggregated engine's last prefill chunk draws it (both from the request's
        seed at position N, `RejectionSampler.sample`, R6). With fewer than N-1 computed, the rest of the
        prompt is prefilled here first."""
        self._check_new(req)
        if not 0 < num_computed < req.num_tokens:
            raise ValueError(f"num_computed: expected 1..{req.num_tokens - 1} (prompt length - 1 at most), "
                             f"got {num_computed}")
        self.cache.adopt(req, block_ids, state_slot, num_computed)
        if self.prefix is not None:  # its full blocks hold final KV: a later transfer of the same prefix skips them
            self.prefix.remember(req, num_computed // self.cache.block_size)
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = num_computed
        to_decode = num_computed == req.num_tokens - 1
        req.num_prefill_tokens = num_computed if to_decode else req.num_tokens
        self.requests[req.request_id] = req
        self._insert_running(req)
