"""The side channel: a small typed RPC over TCP next to NIXL, for the handshake and lease renewals.

Frames are a 4-byte big-endian length and a msgpack-encoded tagged struct. Each call is one short
connection with a deadline, so a dead peer surfaces as `PeerUnreachable` within that deadline. With a cluster
credential every request carries its token and the server answers nothing (not even its metadata, whose
memory registrations say where its pools are) to a request without it; with an SSL context the connection is TLS.
A renewal names the lease id its handle carries, so that only the holder of a handle can extend its lease.
"""

from __future__ import annotations

import socket
import socketserver
import ssl
import threading
from collections.abc import Callable

import msgspec

from baton.proto.auth import ClusterCredential
from baton.serving.listen_error import CannotListen
from baton.transfer.errors import LeaseExpired, PeerUnauthenticated, PeerUnreachable, TransferError
from baton.transfer.framing import recv_frame, send_frame
from baton.transfer.metadata import AgentMetadata


class GetMetadata(msgspec.Struct, tag=True):
    token: str = ""


class RenewLease(msgspec.Struct, tag=True):
    request_id: str
    lease_id: str
    seconds: float | None = None
    token: str = ""


class MetadataReply(msgspec.Struct, tag=True):
    metadata: AgentMetadata


class LeaseRenewed(msgspec.Struct, tag=True):
    request_id: str
    expires_in: float


class ErrorReply(msgspec.Struct, tag=True):
    kind: str  # "lease_expired" | "bad_request" | "unauthenticated" | "internal"
    message: str


Request = GetMetadata | RenewLease
Reply = MetadataReply | LeaseRenewed | ErrorReply
_req_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


class SideChannelServer:
    """Serves `GetMetadata` and `RenewLease` on a background thread. `renew(request_id, lease_id, seconds)`
    returns the seconds until the new expiry, or raises `LeaseExpired` (no such live lease) or `ValueError` (bad
    seconds). `credential`: requests must carry its token (None: anyone is answered)."""

    def __init__(self, get_metadata: Callable[[], AgentMetadata],
                 renew: Callable[[str, str, float | None], float], host: str = "127.0.0.1", port: int = 0,
                 credential: ClusterCredential | None = None, ssl_context: ssl.SSLContext | None = None) -> None:
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                sock = self.request
                sock.settimeout(10.0)
                try:
                    if ssl_context is not None:
                        sock = ssl_context.wrap_socket(sock, server_side=True)
                    reply = outer._dispatch(recv_frame(sock, "side channel"))
                    send_frame(sock, msgspec.msgpack.encode(reply))
                except (ConnectionError, OSError):
                    return

        self._get_metadata = get_metadata
        self._renew = renew
        self._credential = credential
        self._server = socketserver.ThreadingTCPServer((host, port), Handler, bind_and_activate=False)
        self._server.daemon_threads = True
        self._server.allow_reuse_address = True
        try:
            self._server.server_bind()
        except OSError as e:
            self._server.server_close()
            raise CannotListen(f"side channel: cannot listen on {host}:{port}: {e}") from e
        self._server.server_activate()
        self._thread = threading.Thread(target=self._server.serve_forever, name="baton-side-channel", daemon=True)
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return host, port

    def _dispatch(self, frame: bytes) -> Reply:
        try:
            req = _req_decoder.decode(frame)
        except msgspec.DecodeError as e:
            return ErrorReply("bad_request", str(e))
        if self._credential is not None and not self._credential.accepts(req.token):
            return ErrorReply("unauthenticated", "missing cluster token" if not req.token
                              else "cluster token not accepted")
        try:
            if isinstance(req, GetMetadata):
                return MetadataReply(self._get_metadata())
            return LeaseRenewed(req.request_id, self._renew(req.request_id, req.lease_id, req.seconds))
        except LeaseExpired as e:
            return ErrorReply("lease_expired", str(e))
        except ValueError as e:
            return ErrorReply("bad_request", str(e))
        except Exception as e:  # the peer gets a typed error instead of a dropped connection
            return ErrorReply("internal", f"{type(e).__name__}: {e}")

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


# Seconds a side-channel call may take (connect, then the reply): a peer that accepts but does not answer, a stopped
# process whose listening socket still takes connections, is given up after it.
DEFAULT_TIMEOUT_S = 5.0


class SideChannelClient:
    def __init__(self, host: str, port: int, timeout: float = DEFAULT_TIMEOUT_S,
                 credential: ClusterCredential | None = None,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self._token = credential.token() if credential is not None else ""
        self._ssl = ssl_context

    def _call(self, req: Request) -> Reply:
        peer = f"{self.host}:{self.port}"
        try:
            with socket.create_connection((self.host, self.port), timeout=self.timeout) as raw:
                raw.settimeout(self.timeout)
                sock = self._ssl.wrap_socket(raw, server_hostname=self.host) if self._ssl is not None else raw
                send_frame(sock, msgspec.msgpack.encode(req))
                reply = _reply_decoder.decode(recv_frame(sock, "side channel"))
        except (OSError, ConnectionError, msgspec.DecodeError) as e:
            raise PeerUnreachable(f"side channel {peer}: {type(e).__name__}: {e}", peer=peer) from e
        if isinstance(reply, ErrorReply):
            cls = {"lease_expired": LeaseExpired, "unauthenticated": PeerUnauthenticated}.get(reply.kind,
                                                                                             TransferError)
            raise cls(f"side channel {peer}: {reply.message}", peer=peer)
        return reply

    def metadata(self) -> AgentMetadata:
        reply = self._call(GetMetadata(self._token))
        assert isinstance(reply, MetadataReply)
        return reply.metadata

    def renew(self, request_id: str, lease_id: str, seconds: float | None = None) -> float:
        reply = self._call(RenewLease(request_id, lease_id, seconds, self._token))
        assert isinstance(reply, LeaseRenewed)
        return reply.expires_in
