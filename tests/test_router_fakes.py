"""Fake prefill/decode nodes (real grpc.aio servers) and a router cluster over them, for the router tests.

Holds no tests itself. The fakes produce deterministic tokens that depend only on the prompt (so every path
— disaggregated, local prefill, retried — must give the same answer), can fail, can be slow, and record
every request and Abort they see.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from baton.proto.keepalive import NODE_SERVER_OPTIONS
from baton.proto.v1 import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from baton.router.config import RouterConfig
from baton.router.server import Router, start_router

VOCAB = 1000
MAX_MODEL_LEN = 64
BLOCK_SIZE = 16
DEFAULT_MAX_TOKENS = 16
# Every test coroutine runs under this bound: a hang fails the test instead of stalling the suite.
TEST_TIMEOUT_S = 20.0


def expected_tokens(prompt: Sequence[int], n: int = DEFAULT_MAX_TOKENS) -> list[int]:
    return [(sum(prompt) + 7 * i + 3) % VOCAB for i in range(n)]


# The logprob a fake gives every prompt token it scores: which node scored a prompt shows in the value.
PREFILL_LOGPROB, DECODE_LOGPROB = -0.5, -0.25


def fake_logprobs(ids: Sequence[int], value: float, k: int) -> list[generation_pb2.TokenLogprob]:
    return [generation_pb2.TokenLogprob(token_id=t, logprob=value,
                                        top=[generation_pb2.TopLogprob(token_id=t, logprob=value)] * k) for t in ids]


def spec_totals(k: int, n: int) -> tuple[int, int]:
    """(drafted, accepted) a fake decode worker with `spec_k = k` reports after streaming n tokens."""
    return k * n, n // 2


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, TEST_TIMEOUT_S))


async def eventually(cond: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


class FakeWorker(worker_pb2_grpc.WorkerServicer):
    def __init__(self, role: str, name: str) -> None:
        self.role = role
        self.name = name
        self.model = "fake"  # what Info reports as the model (a node reports its model directory)
        # Failure and speed knobs.
        self.prefill_failures = 0  # the next this-many Prefill calls fail with UNAVAILABLE (-1: all)
        self.prefill_delay_s = 0.0
        self.prefill_wrong_tokens = False  # returns a handle for N tokens instead of N-1
        self.decode_error: grpc.StatusCode | None = None  # every Decode fails with this before any token
        self.decode_fail_after: int | None = None  # UNAVAILABLE after streaming this many tokens
        self.decode_first_delay_s = 0.0  # before the first message (a pull, or a local prefill)
        self.token_delay_s = 0.0
        self.pull_fails = False  # with a handle: answer prefilled_locally=True
        self.load_fails = False
        self.load_silent = False  # Load never answers (a node that stopped answering): the caller's deadline ends it
        self.abort_silent = False  # Abort never answers (and is not recorded): the caller's deadline ends it
        self.script: list[int] | None = None  # output tokens instead of `expected_tokens`
        self.spec_k = 0  # > 0: every token message carries MTP totals `spec_totals(spec_k, tokens so far)`
        # What Load reports.
        self.free_state_slots = 8
        self.free_kv_blocks = 100
        self.outstanding_prefill_tokens = 0
        # What Info reports: the step budget (the router counts a decode worker's prefill backlog in steps of it).
        self.max_num_batched_tokens = 64
        self.has_tokenizer = False  # a grammar needs one (the fake never applies it)
        # Records.
        self.prefills: list[worker_pb2.PrefillRequest] = []
        self.decodes: list[worker_pb2.DecodeRequest] = []
        self.aborts: list[str] = []
        self.active: set[str] = set()
        self._abort_events: dict[str, asyncio.Event] = {}

    def _event(self, rid: str) -> asyncio.Event:
        return self._abort_events.setdefault(rid, asyncio.Event())

    async def _sleep_unless_aborted(self, rid: str, seconds: float) -> bool:
        """Sleeps; True if the request was aborted meanwhile."""
        if seconds <= 0:
            return self._event(rid).is_set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._event(rid).wait(), seconds)
        return self._event(rid).is_set()

    async def Prefill(self, request, context):
        self.prefills.append(request)
        rid = request.request_id
        if self.prefill_failures:
            self.prefill_failures -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name}: prefill failed (fake)")
        self.active.add(rid)
        try:
            if await self._sleep_unless_aborted(rid, self.prefill_delay_s):
                await context.abort(grpc.StatusCode.CANCELLED, f"{self.name}: aborted")
        finally:
            self.active.discard(rid)
        n = len(request.prompt_token_ids) - (0 if self.prefill_wrong_tokens else 1)
        scored = (fake_logprobs(request.prompt_token_ids[1:], PREFILL_LOGPROB, request.prompt_logprobs)
                  if request.HasField("prompt_logprobs") else [])
        return worker_pb2.PrefillResponse(handle=worker_pb2.TransferHandle(
            engine_id=self.name, request_id=rid, num_tokens=n, kv_block_ids=[0], state_slot=0), prompt_logprobs=scored)

    async def Decode(self, request, context):
        self.decodes.append(request)
        rid = request.request_id
        if self.decode_error is not None:
            await context.abort(self.decode_error, f"{self.name}: decode failed (fake)")
        self.active.add(rid)
        try:
            if await self._sleep_unless_aborted(rid, self.decode_first_delay_s):
                await context.write(worker_pb2.DecodeResponse(finish_reason=generation_pb2.FINISH_REASON_ABORT))
                return
            local = not request.HasField("handle") or self.pull_fails
            # A first message without tokens, as a real node may send: the router must not forward it.
            await context.write(worker_pb2.DecodeResponse(prompt_tokens=len(request.prompt_token_ids),
                                                          prefilled_locally=local))
            s = request.sampling
            n = s.max_tokens if s.HasField("max_tokens") else DEFAULT_MAX_TOKENS
            tokens = self.script if self.script is not None else expected_tokens(request.prompt_token_ids, n)
            for i, t in enumerate(tokens):
                if self.decode_fail_after == i:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name}: died mid-stream (fake)")
                if await self._sleep_unless_aborted(rid, self.token_delay_s):
                    await context.write(worker_pb2.DecodeResponse(finish_reason=generation_pb2.FINISH_REASON_ABORT))
                    return
                last = i == len(tokens) - 1
                drafted, accepted = spec_totals(self.spec_k, i + 1) if self.spec_k else (0, 0)
                msg = worker_pb2.DecodeResponse(
                    token_ids=[t], finish_reason=generation_pb2.FINISH_REASON_LENGTH if last else 0,
                    num_drafted_tokens=drafted, num_accepted_tokens=accepted)
                if s.HasField("logprobs"):
                    msg.logprobs.extend(fake_logprobs([t], -1.0 - i, s.logprobs))
                # A node scores the prompt only where it prefilled it (a pulled request never asks).
                if i == 0 and s.HasField("prompt_logprobs") and not request.HasField("handle"):
                    msg.prompt_logprobs.extend(fake_logprobs(request.prompt_token_ids[1:], DECODE_LOGPROB,
                                                             s.prompt_logprobs))
                await context.write(msg)
        finally:
            self.active.discard(rid)

    async def Abort(self, request, context):
        if self.abort_silent:
            await asyncio.sleep(3600)  # cancelled when the caller's deadline passes
        self.aborts.append(request.request_id)
        self._event(request.request_id).set()
        return worker_pb2.WorkerAbortResponse(found=request.request_id in self.active)

    async def Load(self, request, context):
        if self.load_silent:
            await asyncio.sleep(3600)  # cancelled when the caller's deadline passes
        if self.load_fails:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name}: not answering (fake)")
        return worker_pb2.LoadResponse(role=self.role, free_state_slots=self.free_state_slots,
                                       free_kv_blocks=self.free_kv_blocks,
                                       outstanding_prefill_tokens=self.outstanding_prefill_tokens)

    async def Info(self, request, context):
        model = generation_pb2.ModelInfoResponse(model=self.model, vocab_size=VOCAB, max_model_len=MAX_MODEL_LEN,
                                                 layer_pattern="M*", eos_token_ids=[2],
                                                 has_tokenizer=self.has_tokenizer)
        return worker_pb2.InfoResponse(role=self.role, engine_id=self.name, model=model, block_size=BLOCK_SIZE,
                                       max_num_batched_tokens=self.max_num_batched_tokens)


@dataclass
class Cluster:
    prefill: list[FakeWorker]
    decode: list[FakeWorker]
    router: Router
    stub: generation_pb2_grpc.GenerationStub
    servers: dict[str, grpc.aio.Server] = field(default_factory=dict)

    async def generate(self, ids: Sequence[int], request_id: str = "", timeout: float | None = 10.0,
                       **sampling: Any) -> list[generation_pb2.GenerateResponse]:
        req = generation_pb2.GenerateRequest(request_id=request_id, token_ids=generation_pb2.TokenIds(ids=ids),
                                             sampling=generation_pb2.SamplingParams(**sampling))
        return [m async for m in self.stub.Generate(req, timeout=timeout)]

    async def health(self) -> generation_pb2.HealthResponse:
        return await self.stub.Health(generation_pb2.HealthRequest())


def tokens_of(msgs: Sequence[generation_pb2.GenerateResponse]) -> list[int]:
    return [t for m in msgs for t in m.token_ids]


async def start_fake(role: str, name: str) -> tuple[FakeWorker, grpc.aio.Server, str]:
    fake = FakeWorker(role, name)
    # As a node's: the router's keepalive pings are accepted however long a call stays silent.
    server = grpc.aio.server(options=NODE_SERVER_OPTIONS)
    worker_pb2_grpc.add_WorkerServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return fake, server, f"127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def cluster(n_prefill: int = 1, n_decode: int = 1, configure: Callable[[Cluster], None] | None = None,
                  **config: Any) -> AsyncIterator[Cluster]:
    """Fakes, then a router over them. `configure` runs on the fakes before the router's first poll."""
    started = [await start_fake("prefill", f"p{i}") for i in range(n_prefill)]
    started += [await start_fake("decode", f"d{i}") for i in range(n_decode)]
    fakes = [f for f, _, _ in started]
    servers = {f.name: s for f, s, _ in started}
    addrs = [a for _, _, a in started]
    c = Cluster(fakes[:n_prefill], fakes[n_prefill:], None, None, servers)  # type: ignore[arg-type]
    if configure is not None:
        configure(c)
    config.setdefault("load_poll_interval_s", 0.1)
    config.setdefault("control_timeout_s", 1.0)
    router = await start_router(RouterConfig(tuple(addrs[:n_prefill]), tuple(addrs[n_prefill:]), **config))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{router.port}")
    c.router, c.stub = router, generation_pb2_grpc.GenerationStub(channel)
    try:
        yield c
    finally:
        await channel.close()
        await router.stop(0)
        await asyncio.gather(*(s.stop(0) for s in servers.values()))
