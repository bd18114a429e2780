"""Limits of the router's HTTP front (`asgi_server.py`, `openai_http.py`) and their command-line flags.

Every limit answers a client that would otherwise starve or amplify: request size (413), fan-out of one
request into generations (400 naming the field), generations in flight over HTTP (429 with `retry-after`),
connections that send nothing or send slowly (closed), streams whose client stops reading (cancelled).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class HttpLimits:
    # Largest request body; a larger one is refused with 413 before it is read.
    max_request_bytes: int = 16 << 20
    # Most generations one request may ask for: n x the number of prompts.
    max_choices: int = 64
    # Generations in flight over HTTP (every request holds at least one while it is read and parsed);
    # beyond it a request gets 429 with `retry-after`.
    max_in_flight: int = 1024
    # A connection with no request in progress (idle between keep-alive requests, or still sending a request's
    # headers) is closed after this long.
    idle_timeout_s: float = 5.0
    # A request's body must have arrived this long after its headers (else 408).
    body_timeout_s: float = 30.0
    # A response write that cannot proceed this long (the client stopped reading) cancels the request.
    write_timeout_s: float = 60.0
    # Connections the kernel queues before the server accepts them (as gRPC's).
    backlog: int = 4096
    # Deepest JSON nesting a request body may have.
    max_json_depth: int = 32

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0 or v != v or v == float("inf"):
                raise ValueError(f"HttpLimits.{f.name}: expected a finite number > 0, got {v!r}")
            if f.type == "int" and not isinstance(v, int):
                raise ValueError(f"HttpLimits.{f.name}: expected an integer, got {v!r}")


_FLAGS = {
    "max_request_bytes": ("--max-request-bytes", "largest request in bytes: an HTTP body (larger: 413) or a "
                                                 "gRPC request message"),
    "max_choices": ("--max-choices", "most generations one HTTP request may ask for, n x number of prompts "
                                     "(more: 400)"),
    "max_in_flight": ("--http-max-in-flight", "generations in flight over HTTP, requests being read included "
                                              "(beyond: 429 with retry-after)"),
    "idle_timeout_s": ("--http-idle-timeout-s", "seconds before an HTTP connection with no request in progress "
                                                "(idle keep-alive, or request headers still arriving) is closed"),
    "body_timeout_s": ("--http-body-timeout-s", "seconds a request body may take to arrive after its headers "
                                                "(longer: 408)"),
    "write_timeout_s": ("--http-write-timeout-s", "seconds a response write may stall (the client stopped "
                                                  "reading) before the request is cancelled"),
    "backlog": ("--http-backlog", "listen backlog of the HTTP port"),
}


def add_http_limit_args(p: argparse.ArgumentParser) -> None:
    d = HttpLimits()
    for name, (flag, text) in _FLAGS.items():
        default = getattr(d, name)
        p.add_argument(flag, dest=f"http_{name}", type=type(default), default=default,
                       help=f"{text} (default {default})")


def http_limits_from_args(a: argparse.Namespace) -> HttpLimits:
    return HttpLimits(**{name: getattr(a, f"http_{name}") for name in _FLAGS})
