"""Request decoding on every Baton gRPC server (router and nodes): bytes that are not the method's message,
integers too wide for their field, and fields the message does not declare end the call as INVALID_ARGUMENT naming
the message and field.

grpc turns a deserializer's exception into UNKNOWN, so the wrapped deserializer never raises: it returns an
`Undecodable` that the wrapped method answers with INVALID_ARGUMENT. Protobuf parsing truncates a varint that
does not fit a 32-bit field (2**40 + 7 arrives as 7), so every request is also parsed as a "wide" twin of its
message, whose 32-bit integer fields are 64-bit, and each value is checked against its declared type. Protobuf
also keeps a field number it does not know as an "unknown field" and ignores it: a client built against a newer
API would have a request field silently dropped, so such a request is refused naming the field number.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, unknown_fields
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

from baton.proto.v1 import generation_pb2, worker_pb2

_T = FieldDescriptor
# Declared type -> (the wide twin's type, the declared range).
_WIDENED = {
    _T.TYPE_UINT32: (_T.TYPE_UINT64, 0, 2**32),
    _T.TYPE_INT32: (_T.TYPE_INT64, -(2**31), 2**31),
    _T.TYPE_ENUM: (_T.TYPE_INT64, -(2**31), 2**31),
}
_FILES = (generation_pb2.DESCRIPTOR, worker_pb2.DESCRIPTOR)


@dataclass(frozen=True)
class Undecodable:
    """What the wrapped deserializer returns for a request it could not accept."""

    message: str


@cache
def _wide_pool() -> descriptor_pool.DescriptorPool:
    pool = descriptor_pool.DescriptorPool()
    for file in _FILES:
        proto = descriptor_pb2.FileDescriptorProto()
        file.CopyToProto(proto)
        for msg in _all_messages(proto.message_type):
            for f in msg.field:
                if f.type in _WIDENED:
                    f.type = _WIDENED[f.type][0]
                    f.ClearField("type_name")
        pool.Add(proto)
    return pool


def _all_messages(messages: Any) -> list[descriptor_pb2.DescriptorProto]:
    out = []
    for m in messages:
        out += [m, *_all_messages(m.nested_type)]
    return out


@cache
def _wide_class(full_name: str) -> type[Message] | None:
    try:
        return message_factory.GetMessageClass(_wide_pool().FindMessageTypeByName(full_name))
    except KeyError:  # a message of another package: parsed, not range-checked
        return None


def _out_of_range(declared: Descriptor, wide: Message, path: str = "") -> str | None:
    """The first value of `wide` outside its field's declared range, as an INVALID_ARGUMENT message."""
    for field, value in wide.ListFields():
        name = f"{path}{field.name}"
        declared_field = declared.fields_by_name[field.name]
        if field.type == _T.TYPE_MESSAGE and field.message_type.GetOptions().map_entry:
            # A map (of scalar values): its keys are what a truncated varint would change.
            key = declared_field.message_type.fields_by_name["key"]
            if key.type in _WIDENED:
                _, lo, hi = _WIDENED[key.type]
                got = next((k for k in value if not lo <= k < hi), None)
                if got is not None:
                    return f"{name}: expected keys in [{lo}, {hi}), got {got}"
            continue
        if field.type == _T.TYPE_MESSAGE:
            items = value if field.is_repeated else (value,)
            for i, item in enumerate(items):
                where = f"{name}[{i}]." if field.is_repeated else f"{name}."
                if (bad := _out_of_range(declared_field.message_type, item, where)) is not None:
                    return bad
            continue
        if declared_field.type not in _WIDENED:
            continue
        _, lo, hi = _WIDENED[declared_field.type]
        values = value if field.is_repeated else (value,)
        # (min is needed only for signed fields: a wide unsigned value is never negative.)
        if values and (max(values) >= hi or (lo and min(values) < lo)):
            got = next(v for v in values if not lo <= v < hi)
            return f"{name}: expected integers in [{lo}, {hi}), got {got}"
    return None


def _unknown_field(msg: Message, path: str = "") -> str | None:
    """The first field number set in `msg` (or a message inside it) that its type does not declare."""
    for f in unknown_fields.UnknownFieldSet(msg):
        return f"{path}field number {f.field_number}"
    for field, value in msg.ListFields():
        if field.type != _T.TYPE_MESSAGE or field.message_type.GetOptions().map_entry:
            continue
        items = value if field.is_repeated else (value,)
        for i, item in enumerate(items):
            where = f"{path}{field.name}[{i}]." if field.is_repeated else f"{path}{field.name}."
            if (found := _unknown_field(item, where)) is not None:
                return found
    return None


def checked_deserializer(message_class: type[Message]) -> Callable[[bytes], Message | Undecodable]:
    """`message_class.FromString` that returns an `Undecodable` instead of raising or truncating."""
    descriptor = message_class.DESCRIPTOR
    name = descriptor.full_name

    def deserialize(data: bytes) -> Message | Undecodable:
        try:
            msg = message_class.FromString(data)
        except (DecodeError, ValueError, RuntimeError) as e:
            return Undecodable(f"request: expected a serialized {name}, got {len(data)} bytes that do not "
                               f"decode as one ({e})")
        unknown = _unknown_field(msg)
        if unknown is not None:
            return Undecodable(f"request: {name}.{unknown} is not implemented by this server (expected only the "
                               f"fields of {name}; is the client built against a newer API?)")
        wide = _wide_class(name)
        if wide is not None:
            bad = _out_of_range(descriptor, wide.FromString(data))
            if bad is not None:
                return Undecodable(f"{name}.{bad}")
        return msg

    return deserialize


def _message_class(deserializer: Callable[[bytes], Any] | None) -> type[Message] | None:
    owner = getattr(deserializer, "__self__", None)
    return owner if isinstance(owner, type) and issubclass(owner, Message) else None


def _wrap_unary(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def unary(request, context):
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return await behavior(request, context)

    return unary


def _wrap_stream(behavior: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behavior):
        async def stream_gen(request, context):
            if isinstance(request, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            # aclosing: closing this generator (the call was cancelled) closes the method's at once.
            async with contextlib.aclosing(behavior(request, context)) as responses:
                async for response in responses:
                    yield response

        return stream_gen
    return _wrap_unary(behavior)  # a coroutine that writes through context.write


def checked_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """`handler` with its requests decoded by `checked_deserializer` (unchanged where its message is unknown)."""
    cls = _message_class(handler.request_deserializer)
    if cls is None or handler.request_streaming:
        return handler
    deserialize = checked_deserializer(cls)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(_wrap_stream(handler.unary_stream), deserialize,
                                                    handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(_wrap_unary(handler.unary_unary), deserialize,
                                               handler.response_serializer)


class DecodeInterceptor(grpc.aio.ServerInterceptor):
    """Installs `checked_handler` on every method. Put it last among a server's interceptors: the ones before it
    (credentials) then refuse a caller before its bytes are judged."""

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable],
                                details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        return None if handler is None else checked_handler(handler)
