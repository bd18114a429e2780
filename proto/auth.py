"""The cluster credential: what every hop behind the router authenticates with, and what signs transfer handles.

One shared secret (32 random bytes, `ClusterCredential.generate()`) per cluster, given to the router and every
node through `BATON_CLUSTER_SECRET` or a file (`--cluster-secret-file`; Helm mounts a Secret there). It is
never sent: callers send a token derived from it (`token()`) in the `x-baton-cluster-token` gRPC metadata and in
every side-channel frame, and prefill nodes sign each transfer handle with an HMAC under a second derived key,
so that a sniffed token lets nobody forge a handle. A shared secret rather than mutual TLS because it covers
every channel alike (gRPC, the side channel, Ray actors, Helm) with one Secret to mint and rotate, and it is
what binds a handle to the node that leased it; TLS stays available on every hop for confidentiality.

Stdlib only: the router (no torch), the nodes and the transfer layer all import it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

CLUSTER_SECRET_ENV = "BATON_CLUSTER_SECRET"
METADATA_KEY = "x-baton-cluster-token"
SECRET_BYTES = 32
MIN_SECRET_BYTES = 16
MAC_BYTES = 32


def _derive(secret: bytes, purpose: bytes) -> bytes:
    return hmac.new(secret, b"baton-cluster-v1/" + purpose, hashlib.sha256).digest()


def _field_bytes(value: object) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, (list, tuple)):
        return b",".join(_field_bytes(v) for v in value)
    if isinstance(value, float):
        return value.hex().encode()
    return str(value).encode()


def canonical(fields: Sequence[object]) -> bytes:
    """Length-prefixed encoding of `fields`: no two different field lists encode alike."""
    out = bytearray()
    for f in fields:
        b = _field_bytes(f)
        out += len(b).to_bytes(4, "big") + b
    return bytes(out)


@dataclass(frozen=True)
class ClusterCredential:
    secret: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.secret, bytes) or len(self.secret) < MIN_SECRET_BYTES:
            got = len(self.secret) if isinstance(self.secret, bytes) else type(self.secret).__name__
            raise ValueError(f"cluster secret: expected at least {MIN_SECRET_BYTES} bytes, got {got}")

    @classmethod
    def generate(cls) -> ClusterCredential:
        return cls(secrets.token_bytes(SECRET_BYTES))

    def encoded(self) -> str:
        """The secret as text (URL-safe base64), what `BATON_CLUSTER_SECRET` and secret files hold."""
        return base64.urlsafe_b64encode(self.secret).decode()

    @classmethod
    def parse(cls, text: str, source: str = CLUSTER_SECRET_ENV) -> ClusterCredential:
        text = text.strip()
        try:
            secret = base64.urlsafe_b64decode(text.encode("ascii"))
        except (binascii.Error, UnicodeEncodeError, ValueError) as e:
            raise ValueError(f"{source}: expected a URL-safe base64 secret (`baton secret` prints one), got "
                             f"{len(text)} characters that do not decode ({e})") from e
        try:
            return cls(secret)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from e

    @classmethod
    def from_sources(cls, secret_file: str | None = None,
                     environ: Mapping[str, str] | None = None) -> ClusterCredential | None:
        """From `secret_file` if given, else from `BATON_CLUSTER_SECRET`; None when neither is set."""
        env = os.environ if environ is None else environ
        if secret_file is not None:
            try:
                text = Path(secret_file).read_text()
            except OSError as e:
                raise ValueError(f"cluster secret file: expected a readable file, got {secret_file!r} ({e})") from e
            return cls.parse(text, f"cluster secret file {secret_file!r}")
        text = env.get(CLUSTER_SECRET_ENV, "")
        return cls.parse(text) if text.strip() else None

    # ---- calls between the router and the nodes, and to the side channel ----------------------------------
    def token(self) -> str:
        """What a caller presents: derived from the secret, never the secret itself."""
        return _derive(self.secret, b"token").hex()

    def grpc_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((METADATA_KEY, self.token()),)

    def accepts(self, token: str | bytes | None) -> bool:
        """Does a presented token match? Constant time."""
        if token is None:
            return False
        if isinstance(token, str):
            try:
                token = token.encode("ascii")
            except UnicodeEncodeError:
                return False
        return hmac.compare_digest(token, self.token().encode())

    # ---- transfer handles ----------------------------------------------------------------------------------
    def sign(self, fields: Sequence[object]) -> bytes:
        """An HMAC over `fields` (a handle's every field but the MAC) under the handle-signing key."""
        return hmac.new(_derive(self.secret, b"handle"), canonical(fields), hashlib.sha256).digest()

    def verify(self, fields: Sequence[object], mac: bytes) -> bool:
        return len(mac) == MAC_BYTES and hmac.compare_digest(self.sign(fields), mac)


def grpc_token(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    """The cluster token in a call's invocation metadata, or None."""
    for key, value in metadata or ():
        if key == METADATA_KEY:
            return value if isinstance(value, str) else value.decode("ascii", "replace")
    return None
