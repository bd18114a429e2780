"""The asyncio side of `EngineThread`: await engine calls and stream a request's outputs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from baton.engine.engine_thread import EngineThread
from baton.engine.llm_engine import LLMEngine, RequestOutput

T = TypeVar("T")


async def in_engine(thread: EngineThread, fn: Callable[[LLMEngine], T]) -> T:
    """Run `fn(engine)` on the engine thread and await its result (exceptions propagate)."""
    return await asyncio.wrap_future(thread.call(fn))


class OutputStream:
    """Outputs of one request, handed from the engine thread to an asyncio consumer."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

    def push(self, out: RequestOutput) -> None:  # called on the engine thread
        self._loop.call_soon_threadsafe(self._queue.put_nowait, out)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while True:
            out = await self._queue.get()
            yield out
            if out.finished:
                return
