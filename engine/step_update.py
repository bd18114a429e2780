"""A step's effect on its requests once it ran: computed tokens, emitted tokens, the stop and length rules.

Invariants:
- a row of a request aborted (or preempted) since it was scheduled changes nothing;
- a decode row advances its request by its last token plus the accepted drafts; a prefill row by its chunk;
- tokens emitted past a stop, or past max_tokens / max_model_len, are dropped, as plain decoding never made them;
- with async scheduling a launched step is accounted at once (`advance`: a PENDING token per sampling row, so that
  length limits apply exactly) and its values written when read (`resolve`, which applies the stop ids).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from baton.engine.request import PENDING, Request, RequestStatus
from baton.engine.scheduler import Scheduler
from baton.engine.scheduler_output import SchedulerOutput


class StepUpdate:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def update(self, out: SchedulerOutput, sampled: Mapping[str, int | Sequence[int]],
               drafts: Mapping[str, Sequence[int]] | None = None) -> list[Request]:
        """Advance computed tokens, append sampled tokens, apply stop rules. Returns finished requests.

        sampled: per sampling row, its token, or with speculative decoding the tokens it emitted (the
        accepted drafts, then one sampled token); drafts: the next step's drafts per row that drafted.
        """
        sched = self.scheduler
        finished = []
        for row in out.rows:
            req = sched.requests.get(row.request_id)
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
                sched.finish(req, RequestStatus.FINISHED_PREFILLED)
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
        sched = self.scheduler
        for row in out.rows:
            req = sched.requests.get(row.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted or preempted since it was scheduled
            if row.num_draft:
                raise ValueError(f"advance: expected rows without drafts, got {row.num_draft} for {row.request_id!r}")
            req.num_computed_tokens += row.num_tokens
            if req.prefill_only and req.num_computed_tokens == req.num_prefill_tokens:
                sched.finish(req, RequestStatus.FINISHED_PREFILLED)
            elif row.sample:
                req.output_token_ids.append(PENDING)
                if len(req.output_token_ids) >= req.output_limit:
                    sched.finish(req, RequestStatus.FINISHED_LENGTH)

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
                self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
        return True

    def _append(self, req: Request, emitted: list[int]) -> bool:
        """Append emitted tokens up to the first stop; True when the request finished."""
        outputs = req.output_token_ids
        limit = req.output_limit
        for tok in emitted:
            outputs.append(tok)
            if tok in req.stop_ids:
                status = RequestStatus.FINISHED_STOPPED
            elif len(outputs) >= limit:
                status = RequestStatus.FINISHED_LENGTH
            else:
                continue
            # Tokens emitted past a stop are dropped, as non-speculative decoding never made them.
            self.scheduler.finish(req, status)
            return True
        return False
