"""The asyncio side of `EngineThread`: await engine calls and stream a request's outputs."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import weakref
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from baton.engine.engine_thread import EngineThread
from baton.engine.llm_engine import LLMEngine, RequestOutput

T = TypeVar("T")


async def in_engine(thread: EngineThread, fn: Callable[[LLMEngine], T]) -> T:
    """Run `fn(engine)` on the engine thread and await its result (exceptions propagate)."""
    return await asyncio.wrap_future(thread.call(fn))


class _Mailbox:
    """Outputs handed from the engine thread to one event loop, one wake-up per batch rather than per output: a
    decode step at batch B hands over B outputs, and each `call_soon_threadsafe` is a syscall plus a loop turn
    that competes with the engine thread for the GIL."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue[RequestOutput], RequestOutput]] = []

    def put(self, queue: asyncio.Queue[RequestOutput], out: RequestOutput) -> None:  # engine thread
        with self._lock:
            self._items.append((queue, out))
            wake = len(self._items) == 1
        if wake:
            self._loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:  # event loop
        with self._lock:
            items, self._items = self._items, []
        for queue, out in items:
            queue.put_nowait(out)


_mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Mailbox] = weakref.WeakKeyDictionary()


def merge_outputs(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one request as one: `then`'s state, both outputs' new tokens (and their logprobs,
    and the prompt logprobs, which only a request's first output carries)."""
    logprobs = then.logprobs if first.logprobs is None else first.logprobs + (then.logprobs or ())
    return dataclasses.replace(then, new_token_ids=first.new_token_ids + then.new_token_ids, logprobs=logprobs,
                               prompt_logprobs=first.prompt_logprobs if first.prompt_logprobs is not None
                               else then.prompt_logprobs)


class OutputStream:
    """Outputs of one request, handed from the engine thread to an asyncio consumer. A consumer that falls behind
    gets the outputs waiting for it as one (their new tokens together): fewer messages to send exactly when the
    process is busiest."""

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self._mailbox = _mailboxes.get(loop) or _mailboxes.setdefault(loop, _Mailbox(loop))
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

    def push(self, out: RequestOutput) -> None:  # called on the engine thread
        self._mailbox.put(self._queue, out)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while True:
            out = await self._queue.get()
            while not out.finished and not self._queue.empty():
                out = merge_outputs(out, self._queue.get_nowait())
            yield out
            if out.finished:
                return
