"""The side channel: a small typed RPC over TCP next to NIXL, for the handshake and lease renewals.

Frames are a 4-byte big-endian length and a msgpack-encoded tagged struct. Each call is one short
connection with a deadline, so a dead peer surfaces as `PeerUnreachable` within that deadline.
"""

from __future__ import annotations

import socket
import socketserver
import struct
import threading
from collections.abc import Callable

import msgspec

from baton.cli.listen_error import CannotListen
from baton.transfer.errors import LeaseExpired, PeerUnreachable, TransferError
from baton.transfer.metadata import AgentMetadata

_LEN = struct.Struct(">I")
MAX_FRAME = 64 * 2**20


class GetMetadata(msgspec.Struct, tag=True):
    pass


class RenewLease(msgspec.Struct, tag=True):
    request_id: str
    seconds: float | None = None


class MetadataReply(msgspec.Struct, tag=True):
    metadata: AgentMetadata


class LeaseRenewed(msgspec.Struct, tag=True):
    request_id: str
    expires_in: float


class ErrorReply(msgspec.Struct, tag=True):
    kind: str  # "lease_expired" | "bad_request" | "internal"
    message: str


Request = GetMetadata | RenewLease
Reply = MetadataReply | LeaseRenewed | ErrorReply
_req_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


def _send(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_LEN.pack(len(payload)) + payload)


def _recv(sock: socket.socket) -> bytes:
    def exactly(n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("peer closed the side channel mid-frame")
            buf += chunk
        return bytes(buf)

    (n,) = _LEN.unpack(exactly(_LEN.size))
    if n > MAX_FRAME:
        raise ConnectionError(f"side-channel frame: expected at most {MAX_FRAME} bytes, got {n}")
    return exactly(n)


class SideChannelServer:
    """Serves `GetMetadata` and `RenewLease` on a background thread. `renew(request_id, seconds)` returns
    the seconds until the new expiry or raises `LeaseExpired`."""

    def __init__(self, get_metadata: Callable[[], AgentMetadata],
                 renew: Callable[[str, float | None], float], host: str = "127.0.0.1", port: int = 0) -> None:
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                self.request.settimeout(10.0)
                try:
                    reply = outer._dispatch(_recv(self.request))
                    _send(self.request, msgspec.msgpack.encode(reply))
                except (ConnectionError, OSError):
                    return

        self._get_metadata = get_metadata
        self._renew = renew
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
        try:
            if isinstance(req, GetMetadata):
                return MetadataReply(self._get_metadata())
            return LeaseRenewed(req.request_id, self._renew(req.request_id, req.seconds))
        except LeaseExpired as e:
            return ErrorReply("lease_expired", str(e))
        except Exception as e:  # the peer gets a typed error instead of a dropped connection
            return ErrorReply("internal", f"{type(e).__name__}: {e}")

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class SideChannelClient:
    def __init__(self, host: str, port: int, timeout: float = 5.0) -> None:
        self.host, self.port, self.timeout = host, port, timeout

    def _call(self, req: Request) -> Reply:
        peer = f"{self.host}:{self.port}"
        try:
            with socket.create_connection((self.host, self.port), timeout=self.timeout) as sock:
                sock.settimeout(self.timeout)
                _send(sock, msgspec.msgpack.encode(req))
                reply = _reply_decoder.decode(_recv(sock))
        except (OSError, ConnectionError, msgspec.DecodeError) as e:
            raise PeerUnreachable(f"side channel {peer}: {type(e).__name__}: {e}", peer=peer) from e
        if isinstance(reply, ErrorReply):
            cls = LeaseExpired if reply.kind == "lease_expired" else TransferError
            raise cls(f"side channel {peer}: {reply.message}", peer=peer)
        return reply

    def metadata(self) -> AgentMetadata:
        reply = self._call(GetMetadata())
        assert isinstance(reply, MetadataReply)
        return reply.metadata

    def renew(self, request_id: str, seconds: float | None = None) -> float:
        reply = self._call(RenewLease(request_id, seconds))
        assert isinstance(reply, LeaseRenewed)
        return reply.expires_in
