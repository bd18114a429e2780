"""Token-budget scheduler: decode rows first, chunked prefills share the rest, FCFS admission.

Works on ints only (token counts, block ids, slot ids); the runner turns its output into tensors.

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

Async scheduling (K = 0, or a prefill-only engine; `LLMEngine`): step n+1 is scheduled while step n still runs
on the GPU. `advance(out)` accounts for a launched step at once (computed tokens, and a PENDING output token
per sampling row, so that length limits apply exactly); `resolve` writes each token's value once the step's
tokens are read, and applies the stop ids. A request that stops on step n's token was already scheduled
into step n+1: that row's work is dropped. Blocks and state slots freed while a step is in flight (finished,
aborted or preempted requests) may still be written by it, so they stay out of the free lists until the
engine reports that step done (`step_launched` / `step_done`): no new request, and no transfer into a
reserved block, ever shares them with a step in flight.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

from baton.engine.allocator import FreeList
from baton.engine.engine_config import EngineConfig
from baton.engine.request import PENDING, Request, RequestStatus


@dataclass(frozen=True)
class ScheduledRow:
    request_id: str
    token_ids: tuple[int, ...]    # the tokens fed this step (query)
    num_computed_tokens: int      # context already in the caches before this step
    is_decode: bool               # decode phase (state-update path); False: a prefill chunk
    has_initial_state: bool       # False: the Mamba state starts from zeros, the slot is never read
    state_slot: int
    block_ids: tuple[int, ...]    # the request's whole block table after this step's allocation
    sample: bool                  # this step completes the known tokens: sample the next one
    # Decode rows: token_ids = the last token, then num_draft drafts to verify.
    num_draft: int = 0
    # The known token after this row's last one (a chunk's successor in the prompt), else -1: the MTP
    # drafter reads (h_i, t_{i+1}) at every position.
    next_token: int = -1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def _new_row(**fields: object) -> ScheduledRow:
    """ScheduledRow(**fields) given every field, at a third of the cost: a frozen dataclass's __init__ sets each
    field through object.__setattr__, and a decode step builds one row per running request. The instance is
    the same (fields, equality, hash, repr, immutability)."""
    row = object.__new__(ScheduledRow)
    row.__dict__.update(fields)
    return row


@dataclass(frozen=True)
class SchedulerOutput:
    rows: tuple[ScheduledRow, ...]  # decode rows first, then prefill rows
    preempted: tuple[str, ...]

    # Cached (the output is immutable): the runner and the engine's stats read these several times a step.
    @cached_property
    def num_decodes(self) -> int:
        return sum(r.is_decode for r in self.rows)

    @property
    def num_prefills(self) -> int:
        return len(self.rows) - self.num_decodes

    @cached_property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.rows)

    @cached_property
    def token_starts(self) -> list[int]:
        """Where each row's tokens start in the step's flat token list, then the total: query_start_loc as ints
        (row i's last token is token_starts[i + 1] - 1). Shared, not to be modified."""
        starts = [0]
        for r in self.rows:
            starts.append(starts[-1] + len(r.token_ids))
        return starts

    @property
    def is_mixed(self) -> bool:
        return 0 < self.num_decodes < len(self.rows)


class Scheduler:
    def __init__(self, config: EngineConfig, num_blocks: int, num_slots: int) -> None:
        """num_slots: state slots (one per request that holds a state)."""
        self.config = config
        self.block_size = config.block_size
        self.num_spec = 0 if config.prefill_only else config.num_speculative_tokens
        # A row that samples then drafts K tokens, writing the drafter's KV up to K-1 positions ahead.
        self.lookahead = max(0, self.num_spec - 1)
        self.blocks = FreeList(num_blocks, "kv blocks")
        self.slots = FreeList(num_slots, "state slots")
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # ordered by arrival
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        # Steps launched / known done (async scheduling), and what was freed while some were in flight:
        # (the latest step launched then, block ids, state slot or None).
        self.launched = 0
        self.done = 0
        self.quarantine: list[tuple[int, list[int], int | None]] = []

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
        if -(-longest // self.block_size) > self.blocks.capacity:
            raise ValueError(f"request length: expected at most {self.blocks.capacity * self.block_size} tokens "
                             f"(the whole KV pool), got prompt + max_tokens (+ K drafts) = {longest}")

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        self._finish(req, RequestStatus.FINISHED_ABORTED)
        return req

    def abort_prefilled(self, req: Request) -> None:
        """Abort a prefill-only request that finished but was not handed over yet: its held caches go back (after
        the step in flight that wrote them)."""
        if req.status is not RequestStatus.FINISHED_PREFILLED:
            raise ValueError(f"abort_prefilled: expected a prefilled request, got {req.status.value!r} for "
                             f"{req.request_id!r}")
        req.status = RequestStatus.FINISHED_ABORTED
        self._release(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ---------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        cap = self.config.prefill_chunk_cap
        preempted: list[str] = []
        planned: dict[str, int] = {}  # request id -> tokens this step

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

        # 2. running prefills (chunked). Every planned request is running (victims are never planned ones): when
        # all running requests are planned, none is left to prefill.
        for req in (list(self.running) if len(planned) < len(self.running) else ()):
            if budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING or req.in_decode or req.request_id in planned:
                continue
            n = min(req.num_prefill_tokens - req.num_computed_tokens, budget, cap)
            n = self._fit(req, n)
            if n == 0 and self._reserve(req, 1, planned, preempted):
                n = self._fit(req, min(req.num_prefill_tokens - req.num_computed_tokens, budget, cap))
            # The last chunk samples and drafts, writing the drafter's KV up to K-1 positions ahead: it needs
            # that room too (preempting later arrivals, or itself, as a decode row would).
            if (n > 0 and self._last_chunk(req, n) and self.lookahead
                    and not self._reserve(req, n, planned, preempted, self.lookahead)):
                continue
            if n > 0:
                self._allocate_for(req, n)
                planned[req.request_id] = n
                budget = 0 if one_chunk else budget - n

        # 3. admission, FCFS; none in a step that had to preempt (it would only thrash). A request is
        # admitted only if the blocks for its whole prefill are free now, not just for its first chunk.
        free_blocks = self.blocks.num_free
        while (self.waiting and budget > 0 and not preempted and len(self.running) < self.config.max_num_seqs
               and self.slots.can_allocate(1)):
            req = self.waiting[0]
            whole = -(-(req.num_tokens + self.lookahead) // self.block_size)
            if whole > free_blocks:
                break
            free_blocks -= whole
            # A prefill-only request computes all but its last prompt token (R1: decode computes token N).
            req.num_prefill_tokens = req.num_tokens - 1 if req.prefill_only else req.num_tokens
            n = min(req.num_prefill_tokens, budget, cap)
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = 0
            req.state_slot = self.slots.allocate(1)[0]
            self._allocate_for(req, n, self.lookahead if self._last_chunk(req, n) else 0)
            self._insert_running(req)
            planned[req.request_id] = n
            budget = 0 if one_chunk else budget - n

        # Decodes first, each group in arrival order. A decode row stays in `running` (only unplanned requests are
        # preempted, and a prefill or admission never turns a request into a decode within the step).
        rows = [self._decode_row(req, planned[req.request_id]) for req in decoding]
        if len(planned) > len(decoding):
            rows += [self._prefill_row(req, planned[req.request_id]) for req in self.running
                     if req.request_id in planned and not req.in_decode]
        return SchedulerOutput(rows=tuple(rows), preempted=tuple(preempted))

    def update(self, out: SchedulerOutput, sampled: Mapping[str, int | Sequence[int]],
               drafts: Mapping[str, Sequence[int]] | None = None) -> list[Request]:
        """Advance computed tokens, append sampled tokens, apply stop rules. Returns finished requests.

        sampled: per sampling row, its token, or with speculative decoding the tokens it emitted (the
        accepted drafts, then one sampled token); drafts: the next step's drafts per row that drafted.
        """
        finished = []
        for row in out.rows:
            req = self.requests.get(row.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            emitted = sampled.get(row.request_id, ())
            emitted = [emitted] if isinstance(emitted, int) else list(emitted)
            if row.is_decode:
                # The last token and the accepted drafts are now in the caches; the emitted token after
                # them is the next step's input.
                accepted = len(emitted) - 1
                req.num_computed_tokens += 1 + accepted
                if row.num_draft:
                    req.num_verify_steps += 1
                    req.num_drafted += row.num_draft
                    req.num_accepted += accepted
            else:
                req.num_computed_tokens += row.num_tokens
            req.draft_token_ids = list(drafts.get(row.request_id, ())) if drafts else []
            if req.prefill_only and req.num_computed_tokens == req.num_prefill_tokens:
                self._finish(req, RequestStatus.FINISHED_PREFILLED)
                finished.append(req)
                continue
            if row.sample and self._append(req, emitted):
                finished.append(req)
        return finished

    def advance(self, out: SchedulerOutput) -> None:
        """Account for a launched step before its tokens are known (async scheduling; rows without drafts):
        every row's tokens are now computed, and every sampling row gets a PENDING output token, which counts
        toward max_tokens at once. The step finishes requests by length, and prefill-only requests whose prompt
        is computed; stops are found by `resolve`."""
        for row in out.rows:
            req = self.requests.get(row.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted or preempted since it was scheduled
            if row.num_draft:
                raise ValueError(f"advance: expected rows without drafts, got {row.num_draft} for {row.request_id!r}")
            req.num_computed_tokens += row.num_tokens
            if req.prefill_only and req.num_computed_tokens == req.num_prefill_tokens:
                self._finish(req, RequestStatus.FINISHED_PREFILLED)
            elif row.sample:
                req.output_token_ids.append(PENDING)
                if len(req.output_token_ids) >= self._output_limit(req):
                    self._finish(req, RequestStatus.FINISHED_LENGTH)

    def resolve(self, req: Request, index: int, token: int) -> bool:
        """Write the value of req's PENDING output token at `index`, sampled by a step now read, and apply the
        stop ids (a stop drops the PENDING tokens after it and finishes req). False when the token is not
        req's any more: req was aborted, or stopped on an earlier token."""
        outputs = req.output_token_ids
        if req.status is RequestStatus.FINISHED_ABORTED or index >= len(outputs) or outputs[index] != PENDING:
            return False
        outputs[index] = token
        if token in req.stop_ids:
            del outputs[index + 1:]
            if req.status.finished:
                # Finished by length on a later PENDING token: its caches are released already.
                req.status = RequestStatus.FINISHED_STOPPED
            else:
                self._finish(req, RequestStatus.FINISHED_STOPPED)
        return True

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
            need.append(self._blocks_needed(req, row.num_tokens + 1 + self.num_spec, self.lookahead))
        if not self.blocks.can_allocate(sum(need)):
            return None
        for req, b in zip(self.running, need, strict=True):
            self._grow(req, b)
        return [(req.request_id, req.state_slot, self._output_limit(req) - len(req.output_token_ids) - 1,
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

    def step_launched(self) -> int:
        """A step was launched and is not done yet; returns its number."""
        self.launched += 1
        return self.launched

    def step_done(self, step: int) -> None:
        """Every step up to `step` is done: what was freed while they ran goes back to the free lists."""
        self.done = max(self.done, step)
        if self.quarantine and self.quarantine[0][0] <= self.done:
            keep = []
            for item in self.quarantine:
                if item[0] > self.done:
                    keep.append(item)
                else:
                    self._free(item[1], item[2])
            self.quarantine = keep

    def _append(self, req: Request, emitted: list[int]) -> bool:
        """Append emitted tokens up to the first stop; True when the request finished."""
        outputs = req.output_token_ids
        limit = self._output_limit(req)
        for tok in emitted:
            outputs.append(tok)
            if tok in req.stop_ids:
                status = RequestStatus.FINISHED_STOPPED
            elif len(outputs) >= limit:
                status = RequestStatus.FINISHED_LENGTH
            else:
                continue
            # Tokens emitted past a stop are dropped, as non-speculative decoding never made them.
            self._finish(req, status)
            return True
        return False

    # ---- helpers ----------------------------------------------------------------------------------
    def _num_draft(self, req: Request) -> int:
        """Drafts to verify this step: at most K, and none past max_tokens or max_model_len."""
        if not req.draft_token_ids:
            return 0
        room = self._output_limit(req) - len(req.output_token_ids) - 1
        return max(0, min(len(req.draft_token_ids), self.num_spec, room))

    @staticmethod
    def _output_limit(req: Request) -> int:
        """The most output tokens req may have: max_tokens, and max_model_len counting the prompt."""
        return min(req.sampling.max_tokens, req.max_model_len - len(req.prompt_token_ids))

    def _last_chunk(self, req: Request, n: int) -> bool:
        return req.num_computed_tokens + n == req.num_tokens and not req.prefill_only

    def _decode_row(self, req: Request, n: int) -> ScheduledRow:
        """The last token and n - 1 drafts to verify; a decode row always samples."""
        assert req.state_slot is not None
        k = n - 1
        return _new_row(
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

    def _blocks_needed(self, req: Request, n: int, lookahead: int = 0) -> int:
        total = -(-(req.num_computed_tokens + n + lookahead) // self.block_size)
        return max(0, total - len(req.block_ids))

    def _allocate_for(self, req: Request, n: int, lookahead: int = 0) -> None:
        self._grow(req, self._blocks_needed(req, n, lookahead))

    def _grow(self, req: Request, need: int) -> None:
        """need more blocks for req, right after its last one where free (one run: one transfer descriptor)."""
        if need:
            req.add_blocks(self.blocks.allocate(need, after=req.block_ids[-1] if req.block_ids else None))

    def _fit(self, req: Request, n: int) -> int:
        """Largest m <= n whose blocks fit in the request's blocks plus the free pool."""
        room = (len(req.block_ids) + self.blocks.num_free) * self.block_size - req.num_computed_tokens
        return max(0, min(n, room))

    def _reserve(self, req: Request, n: int, planned: dict[str, int], preempted: list[str],
                 lookahead: int = 0) -> bool:
        """Make room for n tokens of req (plus lookahead positions), preempting the latest-arrived unplanned
        running requests. Returns False when req itself had to be preempted.
        """
        # Preempting others does not change what req needs: count it once.
        need = self._blocks_needed(req, n, lookahead)
        while not self.blocks.can_allocate(need):
            # Lowest priority = latest arrival among those not yet given tokens this step (maybe req).
            victim = [r for r in self.running if r.request_id not in planned][-1]
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is req:
                return False
        # Most decode steps stay inside the last block: nothing to allocate.
        self._grow(req, need)
        return True

    def _preempt(self, req: Request) -> None:
        self._release(req)
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

    def _release(self, req: Request) -> None:
        blocks, slot = req.block_ids, req.state_slot
        req.set_blocks([])
        req.state_slot = None
        if self.launched > self.done:
            # A step in flight may still write them: free once it is done (step_done).
            if blocks or slot is not None:
                self.quarantine.append((self.launched, blocks, slot))
        else:
            self._free(blocks, slot)

    def _free(self, blocks: list[int], slot: int | None) -> None:
        if blocks:
            self.blocks.free(blocks)
        if slot is not None:
            self.slots.free([slot])

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.status.finished:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if status is not RequestStatus.FINISHED_PREFILLED:
            self._release(req)
        req.status = status
        del self.requests[req.request_id]

    def reserve(self, num_blocks: int) -> tuple[list[int], int] | None:
        """Blocks and a state slot for a request whose caches arrive from elsewhere (a transfer), or None
        when they are not free now. Give them back with `free_held` if the transfer fails."""
        if not self.slots.can_allocate(1) or not self.blocks.can_allocate(num_blocks):
            return None
        return self.blocks.allocate(num_blocks), self.slots.allocate(1)[0]

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
        if len(block_ids) * self.block_size < num_computed:
            raise ValueError(f"block_ids: expected room for {num_computed} tokens, got {len(block_ids)} blocks")
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = num_computed
        to_decode = num_computed == req.num_tokens - 1
        req.num_prefill_tokens = num_computed if to_decode else req.num_tokens
        req.set_blocks(list(block_ids))
        req.state_slot = state_slot
        self.requests[req.request_id] = req
        self._insert_running(req)

    def free_held(self, block_ids: list[int] | tuple[int, ...], state_slot: int) -> None:
        """Return the caches of a prefilled (held) request to the pools once its lease is over."""
        self._free(list(block_ids), state_slot)
