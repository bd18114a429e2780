"""A node's side of the cluster's trust: the cluster credential every caller must present, and optional TLS on
its gRPC port and side channel (`proto/auth.py` says why a shared secret).

A node refuses to start without a credential unless told `--insecure-no-cluster-auth`: a node that answers
anyone is a way around the router's API keys, and the transfer handles it signs are what keep one request's
caches out of another's reach.
"""

from __future__ import annotations

import argparse
import logging
import ssl
from dataclasses import dataclass, field

import grpc

from baton.proto.auth import CLUSTER_SECRET_ENV, ClusterCredential
from baton.proto.auth_grpc import ClusterTokenInterceptor
from baton.serving.listen_error import CannotListen
from baton.serving.pem import read_pem

log = logging.getLogger("baton.node")


def add_cluster_auth_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster trust")
    g.add_argument("--cluster-secret-file", default=None,
                   help=f"file holding the cluster secret (default: ${CLUSTER_SECRET_ENV}); the router and every "
                        "node of a cluster share it, and each call to this node must present its token")
    g.add_argument("--insecure-no-cluster-auth", action="store_true",
                   help="serve without a cluster secret: anyone who reaches this node's ports may call it and hand "
                        "it transfer handles (only on a network no one else reaches)")
    g.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve gRPC and the side channel over TLS")
    g.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    g.add_argument("--tls-ca", default=None,
                   help="PEM CA bundle that peers' certificates are checked against (a decode node reading from "
                        "prefill nodes that serve TLS)")


def _pem(flag: str, path: str | None) -> bytes | None:
    return read_pem(flag, path) if path is not None else None


@dataclass(frozen=True)
class NodeSecurity:
    credential: ClusterCredential | None
    tls_cert: bytes | None = field(default=None, repr=False)
    tls_key: bytes | None = field(default=None, repr=False)
    tls_ca: bytes | None = field(default=None, repr=False)
    # Paths, because the stdlib's ssl contexts load certificates from files.
    tls_paths: tuple[str | None, str | None, str | None] = (None, None, None)

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls: expected both --tls-cert and --tls-key, or neither, got only one")

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> NodeSecurity:
        credential = ClusterCredential.from_sources(a.cluster_secret_file)
        if credential is None and not a.insecure_no_cluster_auth:
            raise ValueError(f"cluster secret: expected ${CLUSTER_SECRET_ENV} or --cluster-secret-file (the router "
                             "and every node of the cluster share one; `baton secret` prints a new one), got "
                             "neither; --insecure-no-cluster-auth serves without one")
        if credential is None:
            log.warning("no cluster secret: anyone who reaches this node's ports may call it")
        return cls(credential, _pem("--tls-cert", a.tls_cert), _pem("--tls-key", a.tls_key),
                   _pem("--tls-ca", a.tls_ca), (a.tls_cert, a.tls_key, a.tls_ca))

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [ClusterTokenInterceptor(self.credential)] if self.credential is not None else []

    def add_port(self, server: grpc.aio.Server, host: str, port: int) -> int:
        """Bind the node's gRPC port (TLS-only with a certificate); a port it cannot bind raises `CannotListen`."""
        try:
            if self.tls_cert is not None:
                creds = grpc.ssl_server_credentials([(self.tls_key, self.tls_cert)])
                return server.add_secure_port(f"{host}:{port}", creds)
            return server.add_insecure_port(f"{host}:{port}")
        except RuntimeError as e:
            raise CannotListen(f"node: cannot listen on {host}:{port}: {e}") from e

    def side_channel_server_ssl(self) -> ssl.SSLContext | None:
        cert, key, _ = self.tls_paths
        if cert is None:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(cert, key)
        return ctx

    def side_channel_client_ssl(self) -> ssl.SSLContext | None:
        _, _, ca = self.tls_paths
        return ssl.create_default_context(cafile=ca) if ca is not None else None
