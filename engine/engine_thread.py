"""Runs an `LLMEngine` on its own thread for a server: every engine call happens on that thread.

Servers hand work in with `call(fn)` (runs `fn(engine)` between steps, returns a Future) and register
per-request output callbacks; `step_hooks` run after every step (e.g. lease bookkeeping). Callbacks are
invoked on the engine thread: they must only hand the output over (e.g. to an asyncio loop), never block.

Hooks and callbacks only observe the engine: one that raises is logged and counted (`observer_errors`), and
the loop goes on, so that a faulty metric or consumer cannot stop every other request. A callback that
raised cannot take its request's outputs any more, so that request is aborted (its caches freed).
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from typing import TypeVar

from baton.engine.llm_engine import LLMEngine, RequestOutput

T = TypeVar("T")
IDLE_WAIT_S = 0.005
log = logging.getLogger("baton.engine")


class EngineThread:
    def __init__(self, engine: LLMEngine, name: str = "baton-engine") -> None:
        self.engine = engine
        self._calls: queue.SimpleQueue[tuple[Callable[[LLMEngine], object], concurrent.futures.Future]] = (
            queue.SimpleQueue())
        self._callbacks: dict[str, Callable[[RequestOutput], None]] = {}
        self.step_hooks: list[Callable[[LLMEngine], None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.error: BaseException | None = None
        # Step hooks and output callbacks that raised (each logged; the loop went on).
        self.observer_errors = 0

    def start(self) -> EngineThread:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def alive(self) -> bool:
        """Started, not stopped, and its loop has not died."""
        return self._thread.is_alive() and self.error is None

    def call(self, fn: Callable[[LLMEngine], T]) -> concurrent.futures.Future[T]:
        """Run `fn(engine)` on the engine thread before its next step."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        if self.error is not None:
            fut.set_exception(RuntimeError(f"engine thread died: {self.error!r}"))
            return fut
        self._calls.put((fn, fut))
        return fut

    def on_output(self, request_id: str, callback: Callable[[RequestOutput], None]) -> None:
        """Deliver every output of `request_id` to `callback` (dropped after the finished one).
        Register it from an engine-thread call that adds the request, so that no output is missed."""
        self._callbacks[request_id] = callback

    def abort(self, request_id: str) -> concurrent.futures.Future[bool]:
        """Abort a request; its callback gets a last output with finish_reason "abort" (so that a consumer
        waiting for the finished output wakes up) and is dropped. The Future says whether it was live."""

        def run(engine: LLMEngine) -> bool:
            req = engine.scheduler.requests.get(request_id)
            found = engine.abort(request_id)
            cb = self._callbacks.pop(request_id, None)
            if cb is not None:
                tokens = req.resolved_output_ids() if req is not None else ()
                cb(RequestOutput(request_id=request_id, prompt_token_ids=tuple(req.prompt_token_ids) if req else (),
                                 token_ids=tokens, new_token_ids=(), finished=True, finish_reason="abort"))
            return found

        return self.call(run)

    def _run_calls(self, block: bool) -> None:
        try:
            fn, fut = self._calls.get(timeout=IDLE_WAIT_S) if block else self._calls.get_nowait()
        except queue.Empty:
            return
        while True:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.engine))
                except BaseException as e:  # handed to the caller, the loop goes on
                    fut.set_exception(e)
            try:
                fn, fut = self._calls.get_nowait()
            except queue.Empty:
                return

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                # Idle, or stalled until held blocks come back: wait for calls instead of spinning.
                busy = self.engine.has_unfinished() and self.engine.last_step_rows > 0
                self._run_calls(block=not busy)
                if self.engine.has_unfinished():
                    for out in self.engine.step():
                        cb = self._callbacks.get(out.request_id)
                        if cb is not None:
                            if out.finished:
                                del self._callbacks[out.request_id]
                            self._deliver(cb, out)
                for hook in self.step_hooks:
                    try:
                        hook(self.engine)
                    except Exception:
                        self.observer_errors += 1
                        log.exception("step hook %r raised; the engine goes on", hook)
        except BaseException as e:
            self.error = e
            raise

    def _deliver(self, cb: Callable[[RequestOutput], None], out: RequestOutput) -> None:
        try:
            cb(out)
        except Exception:
            self.observer_errors += 1
            log.exception("output callback of request %s raised; the request is aborted", out.request_id)
            self._callbacks.pop(out.request_id, None)
            if not out.finished:
                self.engine.abort(out.request_id)
