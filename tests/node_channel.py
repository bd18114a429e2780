"""Blocking channels to a node that present this test run's cluster token, as the router's do."""

from __future__ import annotations

import grpc

from baton.proto.auth import ClusterCredential
from baton.proto.auth_grpc import cluster_channel


def node_channel(addr: str) -> grpc.Channel:
    """Closing the returned channel closes the underlying one too (it is a context manager as well)."""
    return cluster_channel(grpc.insecure_channel(addr), ClusterCredential.from_sources())
