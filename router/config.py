"""Router configuration: worker addresses and discovery, conditional disaggregation, polling and deadlines."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from baton.proto.message_limits import WORKER_MAX_MESSAGE_BYTES


def _bad(field_name: str, expected: str, got: Any) -> ValueError:
    return ValueError(f"RouterConfig.{field_name}: expected {expected}, got {got!r}")


def _is_host_port(a: Any) -> bool:
    host, sep, port = a.rpartition(":") if isinstance(a, str) else ("", "", "")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)


def _check_addrs(field_name: str, addrs: Any, at_least: int, alternative: str = "") -> tuple[str, ...]:
    if not isinstance(addrs, list | tuple):
        raise _bad(field_name, "a tuple of 'HOST:PORT' strings", addrs)
    for a in addrs:
        if not _is_host_port(a):
            raise _bad(field_name, "addresses of the form 'HOST:PORT' with PORT in [1, 65535]", a)
    if len(set(addrs)) != len(addrs):
        raise _bad(field_name, "distinct addresses", addrs)
    if len(addrs) < at_least:
        raise _bad(field_name, f"at least {at_least} address(es){alternative}", addrs)
    return tuple(addrs)


def _check_dns(field_name: str, target: Any) -> None:
    if target is not None and not _is_host_port(target):
        raise _bad(field_name, "None or 'NAME:PORT' with PORT in [1, 65535]", target)


def _check_seconds(cfg: RouterConfig, field_name: str) -> None:
    v = getattr(cfg, field_name)
    ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0
    if not ok:
        raise _bad(field_name, "a finite number of seconds > 0", v)


def _check_limits(cfg: RouterConfig) -> None:
    for name in ("max_inflight_requests", "max_inflight_per_client", "max_stop_ids"):
        v = getattr(cfg, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise _bad(name, "an integer >= 1", v)
    v = cfg.max_logprobs
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise _bad("max_logprobs", "an integer >= 0", v)
    v = cfg.max_request_bytes
    if not isinstance(v, int) or isinstance(v, bool) or not 1024 <= v <= WORKER_MAX_MESSAGE_BYTES:
        raise _bad("max_request_bytes", f"an integer in [1024, {WORKER_MAX_MESSAGE_BYTES}]", v)
    _check_seconds(cfg, "stream_write_timeout_s")


def _check_prefix_affinity(cfg: RouterConfig) -> None:
    w = cfg.prefix_affinity_weight
    if not isinstance(w, int | float) or isinstance(w, bool) or not math.isfinite(w) or w < 0:
        raise _bad("prefix_affinity_weight", "a finite number >= 0", w)
    for name in ("prefix_index_blocks", "prefix_block_size"):
        v = getattr(cfg, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise _bad(name, "an integer >= 1", v)


@dataclass(frozen=True)
class RouterConfig:
    # Static workers. Either role may also (or only) be discovered through DNS, below.
    prefill_addrs: tuple[str, ...] = ()
    decode_addrs: tuple[str, ...] = ()
    # Prompts of length <= threshold go straight to decode, which prefills them locally: for short prompts
    # a transfer costs more than recomputing. Length 1 always does (there are no N-1 tokens to prefill).
    local_prefill_threshold: int = 0
    # Queue-aware disaggregation: when every healthy prefill worker has more than this many prompt tokens
    # queued (its last Load plus what this router sent since, less the two steps it may have in flight:
    # `policy.queued_prefill_tokens`), a new request is prefilled on its decode node instead of waiting there
    # ("prefill_overflow"). The decode node's spare compute then serves past the prefill
    # nodes' capacity, at some cost in its decode steps. 0: off (prefill nodes take every long prompt).
    prefill_queue_limit_tokens: int = 0
    load_poll_interval_s: float = 0.5
    # One Prefill RPC, queueing included; past it the router retries elsewhere, then prefills locally.
    prefill_timeout_s: float = 120.0
    # Longest silence tolerated on a Decode stream (before the first token: pull + queueing + token N).
    decode_idle_timeout_s: float = 120.0
    # Abort, and discovery lookups: small calls that a healthy node answers at once (polls: `poll_timeout_s`).
    control_timeout_s: float = 5.0
    tokenizer_path: str | None = None
    # 'NAME:PORT' of a headless Service: every A/AAAA record of NAME is one worker listening on PORT. The
    # name is resolved again every `dns_refresh_s`, so workers joining or leaving are picked up while running.
    prefill_dns: str | None = None
    decode_dns: str | None = None
    dns_refresh_s: float = 5.0
    # A Ray namespace whose named actors `prefill-*` / `decode-*` are workers (`baton ray up` starts them):
    # each is asked for its gRPC 'HOST:PORT' every `ray_refresh_s`. `ray_address`: the cluster (None: auto).
    ray_namespace: str | None = None
    ray_address: str | None = None
    ray_refresh_s: float = 2.0
    # Consecutive failed Load polls that take a worker out of rotation (one successful poll puts it back).
    # A request that finds a worker UNAVAILABLE takes it out at once.
    unhealthy_after: int = 2
    # Largest gRPC request (and the OpenAI front's largest HTTP body): `--max-request-bytes`. At most
    # `proto.message_limits.WORKER_MAX_MESSAGE_BYTES`, so that what the router accepts the nodes accept too.
    max_request_bytes: int = 16 << 20
    # Generate calls in flight at once, over all clients; beyond it RESOURCE_EXHAUSTED with `retry-after`.
    max_inflight_requests: int = 4096
    # Generate calls in flight at once for one client (its API key when keys are configured, else its
    # connection); beyond it RESOURCE_EXHAUSTED with `retry-after`.
    max_inflight_per_client: int = 1024
    # A response write that cannot complete this long (the client stopped reading) cancels the request,
    # freeing its slot on the nodes.
    stream_write_timeout_s: float = 30.0
    # Most stop token ids one request may carry.
    max_stop_ids: int = 256
    # Most top alternatives a request's logprobs / prompt_logprobs may ask for (the nodes' own bound is
    # `EngineConfig.max_logprobs`).
    max_logprobs: int = 20
    # Deadline of a `Load` / `Info` poll. A worker that lets `unhealthy_after` polls in a row pass it without an
    # answer has stopped answering: it leaves rotation, and the requests it serves are retried elsewhere (nothing
    # streamed yet) or end with UNAVAILABLE. (A frozen process is noticed sooner, by keepalive pings.)
    poll_timeout_s: float = 2.0
    # Prefix affinity (`router/affinity.py`): how many queued prompt tokens on a worker one prompt token it is
    # predicted to hold in its prefix cache is worth. 0: off, workers are picked by load alone.
    prefix_affinity_weight: float = 0.0
    # Chained block hashes the router remembers per worker (`router/prefix_index.py`), least recently sent
    # evicted first.
    prefix_index_blocks: int = 32768
    # Tokens per block of a worker that has not reported its own block size yet.
    prefix_block_size: int = 16

    def __post_init__(self) -> None:
        # Normalise through object.__setattr__ so lists given by callers still make a hashable config.
        object.__setattr__(self, "prefill_addrs", _check_addrs("prefill_addrs", self.prefill_addrs, 0))
        _check_dns("prefill_dns", self.prefill_dns)
        _check_dns("decode_dns", self.decode_dns)
        object.__setattr__(self, "decode_addrs", _check_addrs("decode_addrs", self.decode_addrs,
                                                              0 if self.decode_dns or self.ray_namespace else 1,
                                                              " or decode_dns or ray_namespace"))
        for name in ("ray_namespace", "ray_address"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise _bad(name, "None or a non-empty string", v)
        for name in ("local_prefill_threshold", "prefill_queue_limit_tokens"):
            t = getattr(self, name)
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise _bad(name, "an integer >= 0", t)
        for name in ("load_poll_interval_s", "prefill_timeout_s", "decode_idle_timeout_s", "control_timeout_s",
                     "dns_refresh_s", "ray_refresh_s", "poll_timeout_s"):
            _check_seconds(self, name)
        n = self.unhealthy_after
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise _bad("unhealthy_after", "an integer >= 1", n)
        _check_limits(self)
        _check_prefix_affinity(self)
        p = self.tokenizer_path
        if p is not None and (not isinstance(p, str) or not p):
            raise _bad("tokenizer_path", "None or a non-empty path", p)
