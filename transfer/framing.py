"""Length-prefixed frames over a stream socket: the side channel's and the node ranks' transfer links' wire format."""

from __future__ import annotations

import socket
import struct

_LEN = struct.Struct(">I")
MAX_FRAME = 64 * 2**20


def send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_LEN.pack(len(payload)) + payload)


def recv_frame(sock: socket.socket, what: str) -> bytes:
    """One frame's payload; `what` names the link in the errors (a closed peer, a frame past MAX_FRAME)."""
    (n,) = _LEN.unpack(_exactly(sock, _LEN.size, what))
    if n > MAX_FRAME:
        raise ConnectionError(f"{what} frame: expected at most {MAX_FRAME} bytes, got {n}")
    return _exactly(sock, n, what)


def _exactly(sock: socket.socket, n: int, what: str) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"the other end closed the {what} mid-frame")
        buf += chunk
    return bytes(buf)
