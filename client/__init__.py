"""Python SDK for Baton's gRPC API (`baton.v1.Generation`). Imports no torch.

    from baton.client import Client
    with Client("localhost:50051") as c:
        print(c.generate([1, 2, 3], max_tokens=8).token_ids)
        for chunk in c.stream("Hello", max_tokens=8):
            print(chunk.text, end="")
"""

from baton.client._common import Sampling
from baton.client.async_client import AsyncClient, AsyncStream
from baton.client.client import Client, Stream
from baton.client.errors import (
    BatonError,
    DeadlineExceededError,
    InvalidArgumentError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
)
from baton.client.types import (
    Choice,
    Chunk,
    Completion,
    FinishReason,
    Grammar,
    Health,
    ModelInfo,
    TokenLogprob,
)

__all__ = [
    "AsyncClient", "AsyncStream", "BatonError", "Choice", "Chunk", "Client", "Completion", "DeadlineExceededError",
    "FinishReason", "Grammar", "Health", "InvalidArgumentError", "ModelInfo", "ResourceExhaustedError", "Sampling",
    "Stream", "TokenLogprob", "UnauthenticatedError", "UnavailableError",
]
