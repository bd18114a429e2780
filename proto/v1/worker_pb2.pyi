from baton.proto.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TransferHandle(_message.Message):
    __slots__ = ("engine_id", "agent_name", "request_id", "num_tokens", "kv_block_ids", "state_slot", "lease_expiry", "side_channel_host", "side_channel_port", "lease_id", "mac")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    STATE_SLOT_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRY_FIELD_NUMBER: _ClassVar[int]
    SIDE_CHANNEL_HOST_FIELD_NUMBER: _ClassVar[int]
    SIDE_CHANNEL_PORT_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    agent_name: str
    request_id: str
    num_tokens: int
    kv_block_ids: _containers.RepeatedScalarFieldContainer[int]
    state_slot: int
    lease_expiry: float
    side_channel_host: str
    side_channel_port: int
    lease_id: str
    mac: bytes
    def __init__(self, engine_id: _Optional[str] = ..., agent_name: _Optional[str] = ..., request_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., kv_block_ids: _Optional[_Iterable[int]] = ..., state_slot: _Optional[int] = ..., lease_expiry: _Optional[float] = ..., side_channel_host: _Optional[str] = ..., side_channel_port: _Optional[int] = ..., lease_id: _Optional[str] = ..., mac: _Optional[bytes] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("handle", "prompt_logprobs")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    handle: TransferHandle
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprob]
    def __init__(self, handle: _Optional[_Union[TransferHandle, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "handle")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generation_pb2.SamplingParams
    handle: TransferHandle
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., handle: _Optional[_Union[TransferHandle, _Mapping]] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "prompt_tokens", "prefilled_locally", "num_drafted_tokens", "num_accepted_tokens", "logprobs", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILLED_LOCALLY_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _generation_pb2.FinishReason
    prompt_tokens: int
    prefilled_locally: bool
    num_drafted_tokens: int
    num_accepted_tokens: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_generation_pb2.FinishReason, str]] = ..., prompt_tokens: _Optional[int] = ..., prefilled_locally: _Optional[bool] = ..., num_drafted_tokens: _Optional[int] = ..., num_accepted_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class WorkerAbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class WorkerAbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadResponse(_message.Message):
    __slots__ = ("role", "waiting", "running", "outstanding_prefill_tokens", "free_kv_blocks", "total_kv_blocks", "free_state_slots", "total_state_slots", "held_leases")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_STATE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STATE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    HELD_LEASES_FIELD_NUMBER: _ClassVar[int]
    role: str
    waiting: int
    running: int
    outstanding_prefill_tokens: int
    free_kv_blocks: int
    total_kv_blocks: int
    free_state_slots: int
    total_state_slots: int
    held_leases: int
    def __init__(self, role: _Optional[str] = ..., waiting: _Optional[int] = ..., running: _Optional[int] = ..., outstanding_prefill_tokens: _Optional[int] = ..., free_kv_blocks: _Optional[int] = ..., total_kv_blocks: _Optional[int] = ..., free_state_slots: _Optional[int] = ..., total_state_slots: _Optional[int] = ..., held_leases: _Optional[int] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("role", "engine_id", "model", "block_size", "max_num_batched_tokens", "http_port")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HTTP_PORT_FIELD_NUMBER: _ClassVar[int]
    role: str
    engine_id: str
    model: _generation_pb2.ModelInfoResponse
    block_size: int
    max_num_batched_tokens: int
    http_port: int
    def __init__(self, role: _Optional[str] = ..., engine_id: _Optional[str] = ..., model: _Optional[_Union[_generation_pb2.ModelInfoResponse, _Mapping]] = ..., block_size: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., http_port: _Optional[int] = ...) -> None: ...
