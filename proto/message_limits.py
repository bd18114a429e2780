"""gRPC message size limits shared by the router and the nodes, so that whatever the router accepts and
forwards fits what a node accepts.

A prompt travels as repeated uint32 (up to 5 bytes a token): gRPC's 4 MiB default would refuse long prompts
at the node after the router had accepted them. The router's own limit (`--max-request-bytes`) must stay at
or below `WORKER_MAX_MESSAGE_BYTES`; `router/validation.py` refuses a request whose worker messages could
exceed it.
"""

from __future__ import annotations

WORKER_MAX_MESSAGE_BYTES = 64 << 20


def server_options(max_receive_bytes: int, max_send_bytes: int = WORKER_MAX_MESSAGE_BYTES) -> tuple:
    """`grpc.aio.server(options=...)` receiving messages of up to `max_receive_bytes`."""
    return (("grpc.max_receive_message_length", max_receive_bytes),
            ("grpc.max_send_message_length", max_send_bytes))


# What a node's `grpc.aio.server` is created with.
WORKER_SERVER_OPTIONS = server_options(WORKER_MAX_MESSAGE_BYTES)
