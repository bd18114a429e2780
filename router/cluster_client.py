"""How the router reaches its nodes: every call carries the cluster token (`proto/auth.py`), over TLS when the
cluster has a CA to check the nodes' certificates against."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import grpc

from baton.proto.auth import CLUSTER_SECRET_ENV, ClusterCredential
from baton.proto.auth_grpc import token_interceptors
from baton.serving.pem import read_pem


@dataclass(frozen=True)
class ClusterClient:
    credential: ClusterCredential | None = None
    tls_ca: bytes | None = field(default=None, repr=False)  # PEM: nodes serve TLS, checked against it

    @classmethod
    def from_sources(cls, secret_file: str | None = None, tls_ca: str | None = None, insecure: bool = False,
                     environ: Mapping[str, str] | None = None) -> ClusterClient:
        """The credential from `secret_file` or BATON_CLUSTER_SECRET; without one, only when `insecure`."""
        credential = ClusterCredential.from_sources(secret_file, environ)
        if credential is None and not insecure:
            raise ValueError(f"cluster secret: expected ${CLUSTER_SECRET_ENV} or --cluster-secret-file (the router "
                             "and every node of the cluster share one; `baton secret` prints a new one), got "
                             "neither; --insecure-no-cluster-auth calls the nodes without one")
        return cls(credential, read_pem("--cluster-tls-ca", tls_ca) if tls_ca is not None else None)

    def channel(self, addr: str, options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
        interceptors = token_interceptors(self.credential)
        if self.tls_ca is not None:
            return grpc.aio.secure_channel(addr, grpc.ssl_channel_credentials(self.tls_ca), options=options,
                                           interceptors=interceptors)
        return grpc.aio.insecure_channel(addr, options=options, interceptors=interceptors)
