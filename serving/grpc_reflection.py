"""gRPC server reflection (`grpc.reflection.v1` and `v1alpha`), so that grpcurl and grpc_cli can list and describe
a server's services without their `.proto` files.

Every request kind is answered from the process's default descriptor pool (where the generated stubs registered
their files): list_services (the services the server serves), file_by_filename, file_containing_symbol,
file_containing_extension, all_extension_numbers_of_type. File answers carry the file and its transitive
dependencies, each once per stream, as the protocol allows, so a client needs no second round trip. A name the
pool does not know is answered with an error_response NOT_FOUND on the stream, which stays open.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from types import ModuleType

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import FileDescriptor

from baton.proto.grpc.reflection.v1 import reflection_pb2 as v1_pb2
from baton.proto.grpc.reflection.v1 import reflection_pb2_grpc as v1_grpc
from baton.proto.grpc.reflection.v1alpha import reflection_pb2 as v1alpha_pb2
from baton.proto.grpc.reflection.v1alpha import reflection_pb2_grpc as v1alpha_grpc

REFLECTION_SERVICES = tuple(m.DESCRIPTOR.services_by_name["ServerReflection"].full_name for m in (v1_pb2, v1alpha_pb2))


class _NotFound(Exception):
    pass


class _Reflection:
    """ServerReflectionInfo of one protocol version; `pb2` is that version's message module (same fields)."""

    def __init__(self, pb2: ModuleType, services: Iterable[str], pool: descriptor_pool.DescriptorPool) -> None:
        self._pb2 = pb2
        self._services = tuple(sorted({*services, *REFLECTION_SERVICES}))
        self._pool = pool

    async def ServerReflectionInfo(self, requests: AsyncIterator, context: grpc.aio.ServicerContext):
        sent: set[str] = set()  # files already sent on this stream
        async for request in requests:
            yield self._answer(request, sent)

    def _answer(self, request, sent: set[str]):
        pb2 = self._pb2
        out = pb2.ServerReflectionResponse(valid_host=request.host, original_request=request)
        kind = request.WhichOneof("message_request")
        try:
            if kind == "list_services":
                out.list_services_response.service.extend(pb2.ServiceResponse(name=s) for s in self._services)
            elif kind == "file_by_filename":
                self._files(out, self._find(self._pool.FindFileByName, request.file_by_filename), sent)
            elif kind == "file_containing_symbol":
                file = self._find(self._pool.FindFileContainingSymbol, request.file_containing_symbol)
                self._files(out, file, sent)
            elif kind == "file_containing_extension":
                ext = request.file_containing_extension
                message = self._find(self._pool.FindMessageTypeByName, ext.containing_type)
                field = self._find(lambda n: self._pool.FindExtensionByNumber(message, n), ext.extension_number)
                self._files(out, field.file, sent)
            elif kind == "all_extension_numbers_of_type":
                message = self._find(self._pool.FindMessageTypeByName, request.all_extension_numbers_of_type)
                numbers = sorted(f.number for f in self._pool.FindAllExtensions(message))
                out.all_extension_numbers_response.base_type_name = message.full_name
                out.all_extension_numbers_response.extension_number.extend(numbers)
            else:
                out.error_response.error_code = grpc.StatusCode.INVALID_ARGUMENT.value[0]
                out.error_response.error_message = "message_request: expected one of its kinds, got none"
        except _NotFound as e:
            out.error_response.error_code = grpc.StatusCode.NOT_FOUND.value[0]
            out.error_response.error_message = str(e)
        return out

    @staticmethod
    def _find(lookup, name):
        try:
            return lookup(name)
        except KeyError:
            raise _NotFound(f"{str(name)[:200]!r}: not known to this server") from None

    @staticmethod
    def _files(out, file: FileDescriptor, sent: set[str]) -> None:
        """`file` first, then its dependencies not yet sent on this stream (the asked-for file always goes)."""
        order, stack = [], [file]
        while stack:
            f = stack.pop()
            if f.name in sent and f is not file:
                continue
            sent.add(f.name)
            order.append(f)
            stack.extend(d for d in f.dependencies if d.name not in sent)
        for f in order:
            proto = descriptor_pb2.FileDescriptorProto()
            f.CopyToProto(proto)
            out.file_descriptor_response.file_descriptor_proto.append(proto.SerializeToString())


class _V1(_Reflection, v1_grpc.ServerReflectionServicer):
    pass


class _V1Alpha(_Reflection, v1alpha_grpc.ServerReflectionServicer):
    pass


def add_reflection(server: grpc.aio.Server, services: Iterable[str],
                   pool: descriptor_pool.DescriptorPool | None = None) -> None:
    """Serve reflection (both versions) on `server`, listing `services` (and reflection itself)."""
    services = tuple(services)
    pool = pool or descriptor_pool.Default()
    v1_grpc.add_ServerReflectionServicer_to_server(_V1(v1_pb2, services, pool), server)
    v1alpha_grpc.add_ServerReflectionServicer_to_server(_V1Alpha(v1alpha_pb2, services, pool), server)
