"""The router's front-door security: API keys and TLS.

- API keys: every client call must carry `authorization: Bearer <key>` (gRPC metadata, or the HTTP header
  of the OpenAI-compatible API) naming one of the configured keys; otherwise UNAUTHENTICATED (HTTP 401).
  `Health` and the standard `grpc.health.v1.Health` stay open (load balancers and probes call them without a key),
  as do `/health` and `/metrics`.
  Keys come from a file (one per line, `#` comments) or `BATON_API_KEYS` (comma-separated), never the
  command line, where any user of the host could read them.
- TLS: a PEM certificate chain and private key make the gRPC port TLS-only.

No keys configured means no check (a router inside a trusted network); the CLI says so when it starts.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from baton.proto.auth_grpc import deny_handler
from baton.serving.grpc_health import HEALTH_METHODS
from baton.serving.pem import read_pem

API_KEYS_ENV = "BATON_API_KEYS"
OPEN_METHODS = frozenset({"/baton.v1.Generation/Health", *HEALTH_METHODS})


@dataclass(frozen=True)
class RouterSecurity:
    api_keys: frozenset[str] = frozenset()
    tls_cert_chain: bytes | None = None  # PEM
    tls_private_key: bytes | None = None  # PEM

    def __post_init__(self) -> None:
        if (self.tls_cert_chain is None) != (self.tls_private_key is None):
            raise ValueError("RouterSecurity: expected both a TLS certificate chain and a private key, or "
                             "neither, got only one")
        bad = [k for k in self.api_keys if not k or k != k.strip() or any(c.isspace() for c in k)]
        if bad:
            raise ValueError(f"RouterSecurity.api_keys: expected non-empty keys without whitespace, got "
                             f"{len(bad)} such key(s)")

    @property
    def requires_key(self) -> bool:
        return bool(self.api_keys)

    @property
    def tls(self) -> bool:
        return self.tls_cert_chain is not None

    @classmethod
    def from_sources(cls, api_keys_file: str | None = None, tls_cert: str | None = None,
                     tls_key: str | None = None, environ: dict[str, str] | None = None) -> RouterSecurity:
        """Keys from `api_keys_file` and/or the BATON_API_KEYS variable; TLS from two PEM files."""
        env = os.environ if environ is None else environ
        keys: set[str] = set()
        if api_keys_file is not None:
            try:
                text = Path(api_keys_file).read_text()
            except OSError as e:
                raise ValueError(f"api_keys_file: expected a readable file, got {api_keys_file!r} ({e})") from e
            keys |= {line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")}
            if not keys:
                raise ValueError(f"api_keys_file: expected at least one key, got none in {api_keys_file!r}")
        keys |= {k.strip() for k in env.get(API_KEYS_ENV, "").split(",") if k.strip()}
        if (tls_cert is None) != (tls_key is None):
            raise ValueError(f"tls: expected both --tls-cert and --tls-key, got cert={tls_cert!r}, key={tls_key!r}")
        cert = key = None
        if tls_cert is not None and tls_key is not None:
            cert, key = read_pem("tls_cert", tls_cert), read_pem("tls_key", tls_key)
        return cls(frozenset(keys), cert, key)

    def allows(self, authorization: str | None) -> bool:
        """Does an `authorization` value (`Bearer <key>`) name a configured key? Constant time per key."""
        if not self.api_keys:
            return True
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            return False
        ok = False
        for k in self.api_keys:  # no early exit: the time does not tell which key came close
            ok |= hmac.compare_digest(token.encode(), k.encode())
        return ok

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [ApiKeyInterceptor(self)] if self.api_keys else []

    def server_credentials(self) -> grpc.ServerCredentials | None:
        if not self.tls:
            return None
        return grpc.ssl_server_credentials([(self.tls_private_key, self.tls_cert_chain)])


def principal(authorization: str | None) -> str:
    """Who a call comes from, for scoping its requests: a stable digest of the key in its `authorization` value
    (`Bearer <key>`; never the key itself), or "" for a caller that presented none."""
    if not authorization:
        return ""
    scheme, _, key = authorization.partition(" ")
    if scheme.lower() != "bearer" or not key:
        key = authorization
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:16]


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but the health checks whose metadata lacks a configured key, before any work is done."""

    def __init__(self, security: RouterSecurity) -> None:
        self._security = security

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable],
                                details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method in OPEN_METHODS:
            return handler
        auth = dict(details.invocation_metadata or ()).get("authorization")
        if self._security.allows(auth if isinstance(auth, str) else None):
            return handler
        message = "missing API key" if auth is None else "API key not accepted"
        return deny_handler(handler, grpc.StatusCode.UNAUTHENTICATED, message)
