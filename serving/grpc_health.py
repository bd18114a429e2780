"""The standard `grpc.health.v1.Health` service (Check, List, Watch) over a server's own readiness, for Kubernetes
gRPC probes, `grpc_health_probe` and load balancers.

Every service the server names, and "" (the server as a whole), is SERVING while `ready()` says so and NOT_SERVING
otherwise (starting, no healthy worker, draining). Check of an unknown service is NOT_FOUND; Watch of one is
answered SERVICE_UNKNOWN, as the protocol says. Watch re-reads `ready()` every `watch_interval_s` and sends each
change: readiness follows worker polls and the drain flag, which announce nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable

import grpc

from baton.proto.grpc.health.v1 import health_pb2, health_pb2_grpc

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
_Status = health_pb2.HealthCheckResponse.ServingStatus
SERVING, NOT_SERVING, SERVICE_UNKNOWN = (health_pb2.HealthCheckResponse.SERVING,
                                         health_pb2.HealthCheckResponse.NOT_SERVING,
                                         health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
# The gRPC methods of this service: probes call them without an API key.
HEALTH_METHODS = frozenset(f"/{HEALTH_SERVICE}/{m}" for m in ("Check", "List", "Watch"))


class HealthService(health_pb2_grpc.HealthServicer):
    def __init__(self, services: Iterable[str], ready: Callable[[], bool], watch_interval_s: float = 0.2) -> None:
        """`services`: the full names this server serves (health itself is added); `ready`: cheap, on the loop."""
        if watch_interval_s <= 0:
            raise ValueError(f"HealthService.watch_interval_s: expected > 0, got {watch_interval_s}")
        self.services = frozenset({"", HEALTH_SERVICE, *services})
        self.ready = ready
        self.watch_interval_s = watch_interval_s

    def status(self, service: str) -> _Status:
        if service not in self.services:
            return SERVICE_UNKNOWN
        # The health service itself answers as long as the process runs.
        if service == HEALTH_SERVICE:
            return SERVING
        return SERVING if self.ready() else NOT_SERVING

    async def Check(self, request: health_pb2.HealthCheckRequest,
                    context: grpc.aio.ServicerContext) -> health_pb2.HealthCheckResponse:
        status = self.status(request.service)
        if status == SERVICE_UNKNOWN:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"service: expected one of {sorted(self.services)}, got {request.service[:200]!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def List(self, request: health_pb2.HealthListRequest,
                   context: grpc.aio.ServicerContext) -> health_pb2.HealthListResponse:
        out = health_pb2.HealthListResponse()
        for name in sorted(self.services):
            out.statuses[name].status = self.status(name)
        return out

    async def Watch(self, request: health_pb2.HealthCheckRequest,
                    context: grpc.aio.ServicerContext) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        last = None
        while True:
            status = self.status(request.service)
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            await asyncio.sleep(self.watch_interval_s)
