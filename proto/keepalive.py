"""HTTP/2 keepalive between the router and the nodes: how fast a node that stops answering is noticed.

The router pings every worker channel that has calls in flight (`ROUTER_CHANNEL_OPTIONS`); a node that does not
acknowledge a ping in time (its process frozen, its host or link gone) has its connection closed, and every call on
it ends with UNAVAILABLE at once instead of waiting for its deadline. gRPC's transport threads answer pings, not the
Python interpreter, so a node busy computing (or holding the GIL) still answers them.

Nodes must accept pings that often (`NODE_SERVER_OPTIONS`): a gRPC server by default takes pings more frequent
than every five minutes on a connection with no data flowing as abuse and closes it (GOAWAY "too_many_pings"),
which would end every call in flight on it.
"""

from __future__ import annotations

# Seconds between the router's pings on a channel with calls in flight, and how long an acknowledgement may take.
PING_INTERVAL_S = 1.0
PING_TIMEOUT_S = 2.0
# The shortest interval between pings a node accepts: half the router's, so that timer jitter is never abuse.
NODE_MIN_PING_INTERVAL_S = PING_INTERVAL_S / 2

ROUTER_CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", int(PING_INTERVAL_S * 1000)),
    ("grpc.keepalive_timeout_ms", int(PING_TIMEOUT_S * 1000)),
    # A keepalive ping may be folded into another ping already in flight (gRPC's bandwidth probe), which then
    # waits for this timeout instead (a minute by default).
    ("grpc.http2.ping_timeout_ms", int(PING_TIMEOUT_S * 1000)),
    # Server-streaming calls send no data after their request: keep pinging while they run.
    ("grpc.http2.max_pings_without_data", 0),
)

NODE_SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.http2.min_ping_interval_without_data_ms", int(NODE_MIN_PING_INTERVAL_S * 1000)),
    # A ping racing the end of the channel's last call is not abuse either.
    ("grpc.keepalive_permit_without_calls", 1),
)
