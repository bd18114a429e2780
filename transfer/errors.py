"""Typed transfer failures. The decode side always gets one of these within a bounded time, never a hang."""

from __future__ import annotations


class TransferError(Exception):
    """Base class: something went wrong moving a request's KV blocks and state between nodes."""

    def __init__(self, message: str, request_id: str | None = None, peer: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.peer = peer


class PeerUnreachable(TransferError):
    """The peer's side channel or NIXL agent cannot be reached (dead, wrong address, refused)."""


class IncompatiblePeer(TransferError):
    """The peer's model / cache layout differs from ours; names the first differing field."""

    def __init__(self, field: str, local: object, remote: object, peer: str | None = None) -> None:
        super().__init__(f"incompatible peer {peer!r}: field '{field}' is {remote!r} there, {local!r} here",
                         peer=peer)
        self.field = field
        self.local = local
        self.remote = remote


class TransferFailed(TransferError):
    """NIXL reported an error state for the transfer."""


class TransferTimeout(TransferError):
    """The transfer did not complete within its deadline; its handle was released."""


class LeaseExpired(TransferError):
    """The prefill side no longer holds the request's blocks (lease expired, aborted or never held)."""


class PeerUnauthenticated(TransferError):
    """The peer refused our cluster token (or we sent none): the two sides do not share a cluster secret."""
