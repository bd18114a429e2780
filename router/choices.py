"""`n` choices of one request as `n` Generate requests (fan-out): each a request of its own on the nodes, with its
own noise seed, so that choices differ and a seeded request's choices are reproducible.

Choice 0 keeps the request's seed (n = 1 is the request itself); choice i > 0 gets `choice_seed(seed, i)`, a
SplitMix64 mix of both (distinct for distinct i, below 2**63 as SamplingParams requires). An unseeded request's
choices each draw fresh entropy on their node.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from baton.proto.v1 import generation_pb2

# The most choices one gRPC request may ask for (the OpenAI front's own cap is --max-choices).
MAX_CHOICES = 64
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def choice_seed(seed: int, i: int) -> int:
    """The seed of choice i of a request seeded with `seed` (choice 0: `seed` itself)."""
    if i == 0:
        return seed
    z = (seed + i * _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def fan_out(request: generation_pb2.GenerateRequest, n: int) -> list[generation_pb2.GenerateRequest]:
    """`request` as its n choices: copies with n unset, choice i's seed `choice_seed(seed, i)` and, where the
    request has an id, the id "<id>/<i>" for i > 0."""
    out = []
    for i in range(n):
        r = generation_pb2.GenerateRequest()
        r.CopyFrom(request)
        r.n = 0
        if i and request.sampling.HasField("seed"):
            r.sampling.seed = choice_seed(request.sampling.seed, i)
        if i and request.request_id:
            r.request_id = f"{request.request_id}/{i}"
        out.append(r)
    return out


class ChoiceContext:
    """The context of choice `index` of a gRPC request of n choices: the call's own, with every message written
    under the request's id and the choice's index, one write at a time (the choices share one stream)."""

    def __init__(self, context: grpc.aio.ServicerContext, index: int, request_id: str, lock: asyncio.Lock) -> None:
        self._context, self._index, self._request_id, self._lock = context, index, request_id, lock

    async def write(self, msg: generation_pb2.GenerateResponse) -> None:
        msg.request_id = self._request_id
        msg.index = self._index
        async with self._lock:
            await self._context.write(msg)

    def __getattr__(self, name: str) -> Any:
        # abort, invocation_metadata, time_remaining, set_code, ...: the call's.
        return getattr(self._context, name)
