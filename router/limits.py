"""Admission of Generate calls: at most `max_inflight_requests` in flight over all clients and
`max_inflight_per_client` for one client, so that no client can hold every slot. A call past either limit is
refused at once with RESOURCE_EXHAUSTED and a `retry-after` (seconds) in its trailing metadata.

A client is its API key's principal when keys are configured (one tenant, however many connections it opens),
else its connection (`context.peer()`): without keys a caller could present any header and count as anyone.
"""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import dataclass, fields

import grpc

from baton.router.config import RouterConfig
from baton.router.metrics import CLIENT_LIMIT, GLOBAL_LIMIT
from baton.router.security import principal

# The delay a refused client is told to wait before it retries: slots free as requests finish.
RETRY_AFTER_S = 1


@dataclass(frozen=True)
class Caller:
    # Whose requests these are (`security.principal`): Abort acts only on a caller's own requests.
    principal: str
    # The key the per-client limit counts under; None: the global limit only.
    client: str | None


def caller_of(context: grpc.aio.ServicerContext, keyed: bool) -> Caller:
    """The caller of a call; `keyed`: API keys are configured (the interceptor let only valid keys in).
    The OpenAI front calls Generate with a stand-in context that has neither metadata nor a peer: its
    requests count toward the global limit (the front limits its own clients)."""
    metadata = context.invocation_metadata() if hasattr(context, "invocation_metadata") else None
    auth = dict(metadata or ()).get("authorization")
    p = principal(auth if isinstance(auth, str) else None)
    if keyed:
        return Caller(p, f"key:{p}")
    return Caller(p, context.peer() if hasattr(context, "peer") else None)


@dataclass(frozen=True)
class Refusal:
    reason: str  # a `metrics.REJECT_REASONS`
    message: str


class Admission:
    """Counts calls in flight, globally and per client. Event-loop only (no locking)."""

    def __init__(self, max_inflight: int, max_per_client: int) -> None:
        self.max_inflight = max_inflight
        self.max_per_client = max_per_client
        self.inflight = 0
        self._per_client: Counter[str] = Counter()

    def admit(self, client: str | None) -> Refusal | None:
        """Counts the call in, or says why not (then nothing was counted)."""
        if self.inflight >= self.max_inflight:
            return Refusal(GLOBAL_LIMIT, f"router at capacity: {self.inflight} requests in flight "
                                         f"(--max-inflight-requests {self.max_inflight}); retry later")
        if client is not None and self._per_client[client] >= self.max_per_client:
            return Refusal(CLIENT_LIMIT, f"this client has {self._per_client[client]} requests in flight "
                                         f"(--max-inflight-per-client {self.max_per_client}); retry later")
        self.inflight += 1
        if client is not None:
            self._per_client[client] += 1
        return None

    def release(self, client: str | None) -> None:
        self.inflight -= 1
        if client is not None:
            self._per_client[client] -= 1
            if not self._per_client[client]:
                del self._per_client[client]

    def clients(self) -> int:
        """Clients with a call in flight."""
        return len(self._per_client)


def retry_after_metadata() -> tuple[tuple[str, str], ...]:
    return (("retry-after", str(RETRY_AFTER_S)),)


# RouterConfig field -> (flag, help) of the gRPC front's limits (`--max-request-bytes` is shared with the HTTP
# front: `http_limits.py`).
_FLAGS = {
    "max_inflight_requests": ("--max-inflight-requests", "Generate calls in flight over all clients (beyond: "
                                                         "RESOURCE_EXHAUSTED with retry-after)"),
    "max_inflight_per_client": ("--max-inflight-per-client", "Generate calls in flight for one client, its API key "
                                                             "when keys are configured, else its connection "
                                                             "(beyond: RESOURCE_EXHAUSTED with retry-after)"),
    "stream_write_timeout_s": ("--stream-write-timeout-s", "seconds a response write to a gRPC client may stall "
                                                           "(it stopped reading) before its request is cancelled"),
    "max_stop_ids": ("--max-stop-ids", "most stop token ids one request may carry (more: INVALID_ARGUMENT)"),
    "max_logprobs": ("--max-logprobs", "most top alternatives a request's logprobs / prompt_logprobs (OpenAI: "
                                       "top_logprobs, completions' logprobs) may ask for (more: INVALID_ARGUMENT)"),
}


def add_grpc_limit_args(p: argparse.ArgumentParser) -> None:
    defaults = {f.name: f.default for f in fields(RouterConfig)}
    for name, (flag, text) in _FLAGS.items():
        default = defaults[name]
        p.add_argument(flag, dest=name, type=type(default), default=default, help=f"{text} (default {default})")


def grpc_limits_from_args(a: argparse.Namespace) -> dict:
    """The RouterConfig fields of `add_grpc_limit_args`' flags."""
    return {name: getattr(a, name) for name in _FLAGS}
