"""Book-keeping of one request in flight: which workers may hold something of it right now."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from baton.router.workers import Worker


@dataclass(eq=False)
class InFlight:
    # The id the workers know the request by; `client_id` is the caller's (they differ only when another caller
    # has a request with the same id in flight).
    request_id: str
    prompt_tokens: int
    # Whose request it is (`security.principal`): Generation.Abort acts only for the same principal.
    principal: str = ""
    client_id: str = ""
    # Workers that must be told to Abort unless the request ends normally: a prefill worker while its
    # Prefill runs and while the handle it issued is not yet consumed by a decode worker; a decode worker
    # until its stream ends with a finish reason.
    live: set[Worker] = field(default_factory=set)
    # Workers whose load tracker counts this request (removed when the request ends).
    tracked: set[Worker] = field(default_factory=set)
    # The worker call being awaited; Generation.Abort cancels it to wake the request up.
    call: grpc.aio.Call | None = None
    aborted: bool = False
    # Set by `end`: the status the request ends with instead of an abort message (the router shutting down).
    end_status: tuple[grpc.StatusCode, str] | None = None
    completion_tokens: int = 0
    # MTP totals as the decode worker last reported them (each DecodeResponse carries the totals so far).
    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0
    # For metrics: how the prompt was prefilled (router/metrics.py DECISIONS; "" until decided) and how
    # many worker calls were retried on another worker.
    route: str = ""
    prefill_retries: int = 0
    decode_retries: int = 0

    def __post_init__(self) -> None:
        self.client_id = self.client_id or self.request_id

    def abort(self) -> None:
        self.aborted = True
        if self.call is not None:
            self.call.cancel()

    def end(self, code: grpc.StatusCode, message: str) -> None:
        """Abort on the workers, and end the client's call with `code` and `message`."""
        self.end_status = (code, message)
        self.abort()

    def untrack(self) -> None:
        for w in self.tracked:
            w.tracker.remove(self.request_id)
        self.tracked.clear()
