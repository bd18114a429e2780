"""Transfer handles on the wire: the prefill node signs each one, the decode node checks it before acting on it.

A handle names the prefill node's blocks, state slot and side-channel address. Unchecked, a caller could point a
decode node at another request's caches (block ids and slots are reused deterministically) or at any address.
The MAC covers every field, so a handle is only ever one a prefill node of this cluster leased for this request.
"""

from __future__ import annotations

import grpc

from baton.proto.auth import ClusterCredential
from baton.proto.v1 import worker_pb2 as wk
from baton.transfer.handle import TransferHandle


def _signed_fields(h: wk.TransferHandle) -> tuple[object, ...]:
    return (h.engine_id, h.agent_name, h.request_id, h.num_tokens, tuple(h.kv_block_ids), h.state_slot,
            h.lease_expiry, h.side_channel_host, h.side_channel_port, h.lease_id)


def handle_to_proto(h: TransferHandle, host: str, port: int, credential: ClusterCredential | None) -> wk.TransferHandle:
    """The wire handle, signed when the cluster has a credential."""
    out = wk.TransferHandle(engine_id=h.engine_id, agent_name=h.agent_name, request_id=h.request_id,
                            num_tokens=h.num_tokens, kv_block_ids=list(h.kv_block_ids), state_slot=h.state_slot,
                            lease_expiry=h.lease_expiry, side_channel_host=host, side_channel_port=port,
                            lease_id=h.lease_id)
    if credential is not None:
        out.mac = credential.sign(_signed_fields(out))
    return out


def handle_error(h: wk.TransferHandle, request_id: str, prompt_len: int,
                 credential: ClusterCredential | None) -> tuple[grpc.StatusCode, str] | None:
    """Why a decode node must not use `h` for request `request_id` (a `prompt_len`-token prompt): the status to end
    the call with and its message; None when it may."""
    if credential is not None and not credential.verify(_signed_fields(h), h.mac):
        return grpc.StatusCode.PERMISSION_DENIED, ("handle: its signature does not verify (not issued by a prefill "
                                                   "node of this cluster, or altered since)")
    if h.request_id != request_id:
        return grpc.StatusCode.PERMISSION_DENIED, (f"handle.request_id: expected {request_id!r} (the request's "
                                                   f"own), got {h.request_id!r}")
    if h.num_tokens != prompt_len - 1:
        # R1: the prefill node must have computed exactly N-1 tokens; anything else corrupts the state.
        return grpc.StatusCode.INVALID_ARGUMENT, (f"handle.num_tokens: expected {prompt_len - 1} (prompt length "
                                                  f"- 1), got {h.num_tokens}")
    return None
