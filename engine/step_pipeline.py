"""The steps launched on the device and not read yet, oldest first (async scheduling).

Invariants:
- steps are read in launch order, each once; reading one reports its number done (`CacheManager.step_done`), so
  that the caches released while it ran leave quarantine only then;
- a step's rows keep the requests they were launched for: an id reused since names another request;
- a speculative engine keeps at most one step here between calls, a verify step chained on its predecessor's
  device results before that one was read; its rows are known once the predecessor is read
  (`Scheduler.chained_output`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from baton.engine.pending_step import PendingStep
from baton.engine.request import Request, RequestStatus
from baton.engine.runner import StepOutput
from baton.engine.scheduler_output import ScheduledRow, SchedulerOutput
from baton.engine.spec_runner import VerifyFlight


@dataclass
class LaunchedStep:
    """A step queued on the device, with what reading it needs: exactly one of `pending` (a pipelined step's
    sampled tokens), `flight` (a whole-graph verify step) and `result` (a step that ran synchronously)."""
    step: int                           # its number (CacheManager.step_launched)
    out: SchedulerOutput                # its rows as the scheduler accounts them
    reqs: list[Request]                 # per row
    path: str                           # how it ran (`EngineStats`)
    num_rows: int                       # rows launched (a chained step's may have finished before it ran)
    pending: PendingStep | None = None
    index: list[int] = field(default_factory=list)  # pending: per row, where its PENDING token sits (-1: none)
    flight: VerifyFlight | None = None
    result: StepOutput | None = None

    def drop_aborted(self, requests: dict[str, Request]) -> None:
        """Leave out the rows of requests aborted since launch (their id maybe taken by a new request since): no
        update, no output (their consumer got the abort's)."""
        live = [(row, req) for row, req in zip(self.out.rows, self.reqs, strict=True)
                if requests.get(row.request_id) is req and req.status is RequestStatus.RUNNING]
        if len(live) != len(self.out.rows):
            self.out = SchedulerOutput(rows=tuple(r for r, _ in live), preempted=())
            self.reqs = [req for _, req in live]


class StepPipeline:
    def __init__(self) -> None:
        self.steps: deque[LaunchedStep] = deque()

    def __bool__(self) -> bool:
        return bool(self.steps)

    @property
    def newest(self) -> LaunchedStep | None:
        return self.steps[-1] if self.steps else None

    @property
    def chained(self) -> LaunchedStep | None:
        """The verify step in flight between calls (chained on the last one read), if any."""
        step = self.newest
        return step if step is not None and step.flight is not None else None

    def prefilled(self, request_id: str) -> Request | None:
        """The prefill-only request under `request_id` that a step in flight finished, not handed over yet."""
        return next((r for step in self.steps for r in step.reqs if r.request_id == request_id
                     and r.status is RequestStatus.FINISHED_PREFILLED), None)

    def prefill_tokens_finished(self) -> int:
        """Prefill tokens of the prefill-only requests whose last chunk a step in flight computed."""
        return sum(r.num_prefill_tokens for step in self.steps
                   for row, r in zip(step.out.rows, step.reqs, strict=True)
                   if r.status is RequestStatus.FINISHED_PREFILLED and last_chunk(row, r))


def last_chunk(row: ScheduledRow, req: Request) -> bool:
    """Whether this row completed req's prefill."""
    return row.num_computed_tokens + row.num_tokens == req.num_prefill_tokens
