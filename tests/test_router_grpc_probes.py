"""What probes and tools expect of the router's gRPC port, with real gRPC clients over fake workers: the standard
`grpc.health.v1.Health` service (Check, List, Watch following readiness: SERVING, then NOT_SERVING when the decode
worker goes or the router drains; open without an API key) and server reflection (v1 and v1alpha: list_services,
file_containing_symbol with dependencies, file_by_filename, errors on the stream; behind the API key)."""

from __future__ import annotations

import asyncio

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool

from baton.proto.grpc.health.v1 import health_pb2, health_pb2_grpc
from baton.proto.grpc.reflection.v1 import reflection_pb2 as refl
from baton.proto.grpc.reflection.v1 import reflection_pb2_grpc as refl_grpc
from baton.proto.grpc.reflection.v1alpha import reflection_pb2 as refl_alpha
from baton.proto.grpc.reflection.v1alpha import reflection_pb2_grpc as refl_alpha_grpc
from baton.proto.v1 import worker_pb2  # noqa: F401  (registers worker.proto in the default pool)
from baton.router.config import RouterConfig
from baton.router.security import RouterSecurity
from baton.router.server import start_router
from baton.serving.grpc_reflection import _V1
from tests.test_router_fakes import cluster, eventually, run

S = health_pb2.HealthCheckResponse
SERVICES = ["baton.v1.Generation", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection"]


def test_health_check_list_and_watch_follow_readiness():
    async def go():
        async with cluster() as c:
            await eventually(lambda: c.router.service.health().ok, what="router ready")
            async with grpc.aio.insecure_channel(f"127.0.0.1:{c.router.port}") as ch:
                health = health_pb2_grpc.HealthStub(ch)
                for service in ("", "baton.v1.Generation"):
                    out = await health.Check(health_pb2.HealthCheckRequest(service=service))
                    assert out.status == S.SERVING, service
                try:
                    await health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"))
                    raise AssertionError("expected NOT_FOUND")
                except grpc.aio.AioRpcError as e:
                    assert e.code() == grpc.StatusCode.NOT_FOUND and "no.such.Service" in e.details()
                listed = await health.List(health_pb2.HealthListRequest())
                assert {k: v.status for k, v in listed.statuses.items()} == {
                    "": S.SERVING, "baton.v1.Generation": S.SERVING, "grpc.health.v1.Health": S.SERVING}
                # Watch: the status now, then each change (decode worker gone, back, then the router drains).
                watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
                assert (await watch.read()).status == S.SERVING
                c.decode[0].load_fails = True
                assert (await asyncio.wait_for(watch.read(), 5)).status == S.NOT_SERVING
                c.decode[0].load_fails = False
                assert (await asyncio.wait_for(watch.read(), 5)).status == S.SERVING
                c.router.service.draining = True
                assert (await asyncio.wait_for(watch.read(), 5)).status == S.NOT_SERVING
                out = await health.Check(health_pb2.HealthCheckRequest(service="baton.v1.Generation"))
                assert out.status == S.NOT_SERVING
                watch.cancel()
                unknown = health.Watch(health_pb2.HealthCheckRequest(service="no.such.Service"))
                assert (await unknown.read()).status == S.SERVICE_UNKNOWN
                unknown.cancel()
    run(go())


def test_health_is_not_serving_without_a_decode_worker_and_open_without_a_key():
    async def go():
        security = RouterSecurity(api_keys=frozenset({"k1"}))
        router = await start_router(RouterConfig((), ("127.0.0.1:1",), load_poll_interval_s=0.1), 0,
                                    security=security)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as ch:
                out = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
                assert out.status == S.NOT_SERVING
                # Reflection needs the key, as every other method but health does.
                call = refl_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                    iter([refl.ServerReflectionRequest(list_services="")]))
                try:
                    [m async for m in call]
                    raise AssertionError("expected UNAUTHENTICATED")
                except grpc.aio.AioRpcError as e:
                    assert e.code() == grpc.StatusCode.UNAUTHENTICATED
                call = refl_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                    iter([refl.ServerReflectionRequest(list_services="")]),
                    metadata=(("authorization", "Bearer k1"),))
                names = [s.name for m in [m async for m in call] for s in m.list_services_response.service]
                assert names == SERVICES
        finally:
            await router.stop(0)
    run(go())


def _files(response) -> dict[str, descriptor_pb2.FileDescriptorProto]:
    out = {}
    for raw in response.file_descriptor_response.file_descriptor_proto:
        f = descriptor_pb2.FileDescriptorProto.FromString(raw)
        out[f.name] = f
    return out


def test_reflection_lists_and_describes_the_services():
    async def go():
        async with cluster() as c, grpc.aio.insecure_channel(f"127.0.0.1:{c.router.port}") as ch:
            for pb2, stub in ((refl, refl_grpc.ServerReflectionStub(ch)),
                              (refl_alpha, refl_alpha_grpc.ServerReflectionStub(ch))):
                call = stub.ServerReflectionInfo()
                await call.write(pb2.ServerReflectionRequest(host="h", list_services=""))
                listed = await call.read()
                assert [s.name for s in listed.list_services_response.service] == SERVICES
                assert listed.valid_host == "h" and listed.original_request.list_services == ""
                await call.write(pb2.ServerReflectionRequest(file_containing_symbol="baton.v1.Generation"))
                files = _files(await call.read())
                generation = files["baton/proto/v1/generation.proto"]
                assert [s.name for s in generation.service] == ["Generation"]
                assert {m.name for m in generation.service[0].method} == {"Generate", "Abort", "Health", "ModelInfo"}
                await call.write(pb2.ServerReflectionRequest(
                    file_containing_symbol="grpc.health.v1.HealthCheckResponse.ServingStatus"))
                assert list(_files(await call.read())) == ["baton/proto/grpc/health/v1/health.proto"]
                await call.write(pb2.ServerReflectionRequest(file_by_filename="baton/proto/v1/generation.proto"))
                assert list(_files(await call.read())) == ["baton/proto/v1/generation.proto"]
                # An unknown name is an error on the stream, which goes on.
                await call.write(pb2.ServerReflectionRequest(file_containing_symbol="no.such.Symbol"))
                err = await call.read()
                assert err.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
                assert "no.such.Symbol" in err.error_response.error_message
                await call.write(pb2.ServerReflectionRequest(all_extension_numbers_of_type="baton.v1.TokenIds"))
                ext = await call.read()
                assert ext.all_extension_numbers_response.base_type_name == "baton.v1.TokenIds"
                assert list(ext.all_extension_numbers_response.extension_number) == []
                await call.done_writing()
                assert await call.read() == grpc.aio.EOF
    run(go())


def test_reflection_sends_dependencies_once_per_stream():
    # worker.proto imports generation.proto: the first answer carries both, a later one only what it asked for.
    r = _V1(refl, ["baton.v1.Worker"], descriptor_pool.Default())
    sent: set[str] = set()
    first = _files(r._answer(refl.ServerReflectionRequest(file_containing_symbol="baton.v1.Worker"), sent))
    assert list(first) == ["baton/proto/v1/worker.proto", "baton/proto/v1/generation.proto"]
    again = _files(r._answer(refl.ServerReflectionRequest(file_containing_symbol="baton.v1.Worker"), sent))
    assert list(again) == ["baton/proto/v1/worker.proto"]
