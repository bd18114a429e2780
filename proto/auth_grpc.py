"""The cluster credential on gRPC: the nodes' server interceptor that refuses calls without the cluster token, and
the router's client interceptor that adds it to every call (`proto/auth.py` says what the token is)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc

from baton.proto.auth import METADATA_KEY, ClusterCredential, grpc_token


def deny_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends every call with `code` before doing any work."""

    async def deny_unary(request, context):
        await context.abort(code, message)

    async def deny_stream(request, context):
        await context.abort(code, message)
        yield  # an async generator, as a server-streaming handler must be

    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(deny_stream, handler.request_deserializer,
                                                    handler.response_serializer)
    if handler.stream_stream is not None:  # (server reflection)
        return grpc.stream_stream_rpc_method_handler(deny_stream, handler.request_deserializer,
                                                     handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(deny_unary, handler.request_deserializer,
                                               handler.response_serializer)


class ClusterTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call whose metadata lacks the cluster token (UNAUTHENTICATED), before any work is done."""

    def __init__(self, credential: ClusterCredential) -> None:
        self._credential = credential

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable],
                                details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:
            return handler
        token = grpc_token(details.invocation_metadata)
        if self._credential.accepts(token):
            return handler
        message = ("missing cluster token: this node serves only its cluster's router and nodes"
                   if token is None else "cluster token not accepted")
        return deny_handler(handler, grpc.StatusCode.UNAUTHENTICATED, message)


class _AddToken:
    def __init__(self, credential: ClusterCredential) -> None:
        self._metadata = credential.grpc_metadata()

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        kept = [(k, v) for k, v in (details.metadata or ()) if k != METADATA_KEY]
        return grpc.aio.ClientCallDetails(details.method, details.timeout,
                                          grpc.aio.Metadata(*kept, *self._metadata), details.credentials,
                                          details.wait_for_ready)


class _UnaryUnary(_AddToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _UnaryStream(_AddToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


def token_interceptors(credential: ClusterCredential | None) -> list[grpc.aio.ClientInterceptor]:
    """Client interceptors that send the cluster token on every unary and server-streaming call (none without a
    credential)."""
    if credential is None:
        return []
    return [_UnaryUnary(credential), _UnaryStream(credential)]


class _SyncAddToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, credential: ClusterCredential) -> None:
        self._metadata = credential.grpc_metadata()

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        kept = tuple((k, v) for k, v in (details.metadata or ()) if k != METADATA_KEY)
        return _CallDetails(details.method, details.timeout, kept + self._metadata, details.credentials,
                            getattr(details, "wait_for_ready", None), getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression) -> None:
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = credentials, wait_for_ready, compression


def cluster_channel(channel: grpc.Channel, credential: ClusterCredential | None) -> grpc.Channel:
    """A blocking channel whose every call carries the cluster token (`channel` itself without a credential):
    what tools outside the router (readiness checks, tests) call nodes through."""
    return channel if credential is None else grpc.intercept_channel(channel, _SyncAddToken(credential))
