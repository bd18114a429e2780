"""`baton.client` and `baton client generate` against a small in-process `baton.v1.Generation` server."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from baton.cli import client_cmd
from baton.client import (
    AsyncClient,
    BatonError,
    Client,
    InvalidArgumentError,
    UnauthenticatedError,
    UnavailableError,
)
from baton.proto.v1 import generation_pb2 as pb
from baton.proto.v1 import generation_pb2_grpc

CHUNK = 2  # tokens per streamed message, as a decode node with MTP sends 1+accepted at a time


def fake_tokens(prompt: list[int], n: int) -> list[int]:
    return [(sum(prompt) + 7 * i) % 1000 + 1 for i in range(n)]


def fake_spec(n_messages: int, n_tokens: int) -> dict[str, int]:
    """MTP totals as the fake reports them: 2 drafts per message, each message 1 + accepted tokens."""
    return {"drafted": 2 * n_messages, "accepted": n_tokens - n_messages}


def _prompt_ids(req: pb.GenerateRequest) -> list[int]:
    if req.WhichOneof("prompt") == "text":
        return [ord(c) for c in req.text]
    return list(req.token_ids.ids)


class FakeRouter(generation_pb2_grpc.GenerationServicer):
    """Deterministic token streams plus the failures a real router produces, each switched on by a test."""

    def __init__(self) -> None:
        self.addr = ""
        self.lock = threading.Condition()
        self.calls: dict[str, int] = {}
        self.authorization: list[str | None] = []
        self.required_key: str | None = None
        self.unavailable_first = 0          # fail this many calls (any method) with UNAVAILABLE
        self.fail_after: int | None = None  # Generate: UNAVAILABLE after this many messages
        self.token_delay = 0.0
        self.first_delay: Callable[[list[int]], float] = lambda prompt: 0.0
        self.running: set[str] = set()
        self.aborted: set[str] = set()
        self.cancelled: list[str] = []
        self.cancel_seen = threading.Event()
        self.finished_order: list[list[int]] = []
        self.inflight = self.peak_inflight = 0
        self.gather = 0  # Generate: each stream waits (up to 10 s) until this many are in flight at once
        self.samplings: list[pb.SamplingParams] = []  # Generate: each request's sampling, as received

    def _enter(self, method: str, context: grpc.ServicerContext) -> None:
        auth = dict(context.invocation_metadata()).get("authorization")
        with self.lock:
            self.calls[method] = self.calls.get(method, 0) + 1
            self.authorization.append(auth)
            fail = self.unavailable_first > 0
            self.unavailable_first -= fail
        if self.required_key is not None and auth != f"Bearer {self.required_key}":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad api key")
        if fail:
            context.abort(grpc.StatusCode.UNAVAILABLE, "no decode worker yet")

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        self._enter("Generate", context)
        sp = request.sampling
        self.samplings.append(sp)
        if sp.max_tokens == 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be >= 1")
        prompt = _prompt_ids(request)
        rid = request.request_id or f"router-{self.calls['Generate']}"
        state = {"done": False}

        def on_end() -> None:
            # Runs when the RPC ends however it ends; before the stream's own end it means the client cancelled.
            if not state["done"]:
                self.cancelled.append(rid)
                self.cancel_seen.set()

        context.add_callback(on_end)
        with self.lock:
            self.running.add(rid)
            self.inflight += 1
            self.peak_inflight = max(self.peak_inflight, self.inflight)
            self.lock.notify_all()
            self.lock.wait_for(lambda: self.peak_inflight >= self.gather, timeout=10.0)
        try:
            yield from self._stream(rid, prompt, sp, context)
        finally:
            with self.lock:
                self.running.discard(rid)
                self.inflight -= 1
        state["done"] = True
        self.finished_order.append(prompt)

    def _stream(self, rid: str, prompt: list[int], sp: pb.SamplingParams,
                context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        time.sleep(self.first_delay(prompt))
        tokens = fake_tokens(prompt, sp.max_tokens)
        stops = set(sp.stop_token_ids)
        out: list[int] = []
        for sent, start in enumerate(range(0, len(tokens), CHUNK)):
            if not context.is_active():
                return
            if self.fail_after is not None and sent == self.fail_after:
                context.abort(grpc.StatusCode.UNAVAILABLE, "decode node died")
            new = []
            for t in tokens[start:start + CHUNK]:
                new.append(t)
                if t in stops:
                    break
            out += new
            reason = pb.FINISH_REASON_UNSPECIFIED
            if rid in self.aborted:
                reason = pb.FINISH_REASON_ABORT
            elif new[-1] in stops:
                reason = pb.FINISH_REASON_STOP
            elif len(out) == len(tokens):
                reason = pb.FINISH_REASON_LENGTH
            msg = pb.GenerateResponse(request_id=rid, token_ids=new, text="".join(f"<{t}>" for t in new),
                                      finish_reason=reason)
            if reason != pb.FINISH_REASON_UNSPECIFIED:
                msg.usage.prompt_tokens, msg.usage.completion_tokens = len(prompt), len(out)
                spec = fake_spec(sent + 1, len(out))
                msg.usage.num_drafted_tokens, msg.usage.num_accepted_tokens = spec["drafted"], spec["accepted"]
                yield msg
                return
            yield msg
            time.sleep(self.token_delay)

    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortResponse:
        self._enter("Abort", context)
        found = request.request_id in self.running
        self.aborted.add(request.request_id)
        return pb.AbortResponse(found=found)

    def Health(self, request: pb.HealthRequest, context: grpc.ServicerContext) -> pb.HealthResponse:
        self._enter("Health", context)
        return pb.HealthResponse(ok=True, prefill_workers=2, decode_workers=1)

    def ModelInfo(self, request: pb.ModelInfoRequest, context: grpc.ServicerContext) -> pb.ModelInfoResponse:
        self._enter("ModelInfo", context)
        return pb.ModelInfoResponse(model="demo-small", vocab_size=1024, max_model_len=4096, has_tokenizer=True,
                                    layer_pattern="M*M-", eos_token_ids=[2])


def _serve(servicer: FakeRouter, addr: str = "127.0.0.1:0") -> grpc.Server:
    server = grpc.server(ThreadPoolExecutor(max_workers=32))
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port(addr)
    server.start()
    servicer.addr = f"127.0.0.1:{port}"
    return server


@pytest.fixture
def router() -> Iterator[FakeRouter]:
    servicer = FakeRouter()
    server = _serve(servicer)
    yield servicer
    server.stop(grace=None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- blocking client -------------------------------------------------------------------------------------


def test_generate_equals_collected_stream(router):
    with Client(router.addr) as c:
        done = c.generate([1, 2, 3], max_tokens=5, request_id="r1")
        chunks = list(c.stream([1, 2, 3], max_tokens=5, request_id="r2"))
    assert done.token_ids == tuple(fake_tokens([1, 2, 3], 5))
    assert done.token_ids == tuple(t for ch in chunks for t in ch.token_ids)
    assert done.text == "".join(ch.text for ch in chunks) == "".join(f"<{t}>" for t in done.token_ids)
    assert [ch.finish_reason for ch in chunks] == [None, None, "length"]
    assert (done.request_id, done.finish_reason, done.prompt_token_ids) == ("r1", "length", (1, 2, 3))
    assert (done.prompt_tokens, done.completion_tokens) == (3, 5)
    # The final Usage's MTP totals: 3 messages (2 + 2 + 1 tokens), 2 drafts each.
    assert (done.num_drafted_tokens, done.num_accepted_tokens) == (6, 2)
    assert {ch.request_id for ch in chunks} == {"r2"}


def test_text_prompt_stop_token_and_router_assigned_id(router):
    stop = fake_tokens([ord("h"), ord("i")], 3)[2]
    with Client(router.addr) as c:
        done = c.generate("hi", max_tokens=8, stop_token_ids=[stop])
    assert done.prompt_token_ids is None and done.request_id.startswith("router-")
    assert (done.finish_reason, done.completion_tokens, done.token_ids[-1]) == ("stop", 3, stop)


def test_retries_unavailable_with_backoff(router):
    router.unavailable_first = 2
    t0 = time.perf_counter()
    with Client(router.addr, retries=3, backoff=0.05) as c:
        done = c.generate([4], max_tokens=2)
    assert done.token_ids == tuple(fake_tokens([4], 2))
    assert router.calls["Generate"] == 3
    assert time.perf_counter() - t0 >= 0.05 + 0.1


def test_gives_up_after_retries(router):
    router.unavailable_first = 10
    with Client(router.addr, retries=2, backoff=0.01) as c, pytest.raises(UnavailableError) as e:
        c.generate([4])
    assert e.value.code == "UNAVAILABLE" and "no decode worker" in e.value.message
    assert router.calls["Generate"] == 3


def test_no_retry_after_the_first_chunk(router):
    router.fail_after = 1
    with Client(router.addr, retries=3, backoff=0.01) as c:
        with pytest.raises(BatonError) as e:
            c.generate([5], max_tokens=8)
        assert e.value.code == "UNAVAILABLE"
        s = c.stream([5], max_tokens=8)
        assert next(s).token_ids == tuple(fake_tokens([5], CHUNK))
        with pytest.raises(UnavailableError):
            next(s)
    # A restart would have streamed the first tokens twice.
    assert router.calls["Generate"] == 2


def test_invalid_argument_is_raised_not_retried(router):
    with Client(router.addr, backoff=0.01) as c, pytest.raises(InvalidArgumentError) as e:
        c.generate([1], max_tokens=0)
    assert isinstance(e.value, BatonError) and e.value.code == "INVALID_ARGUMENT"
    assert router.calls["Generate"] == 1


@pytest.mark.parametrize("how", ["close", "with", "drop"])
def test_early_close_cancels_the_call(router, how):
    router.token_delay = 0.02
    with Client(router.addr) as c:
        if how == "close":
            s = c.stream([1], max_tokens=1000, request_id="early")
            next(s)
            s.close()
            assert list(s) == []
        elif how == "with":
            with c.stream([1], max_tokens=1000, request_id="early") as s:
                next(s)
        else:
            for _ in c.stream([1], max_tokens=1000, request_id="early"):
                break
        # Checked before the client closes: closing the channel would cancel the call anyway.
        assert router.cancel_seen.wait(5)
    assert router.cancelled == ["early"]


def test_health_model_info_abort(router):
    router.token_delay = 0.02
    with Client(router.addr) as c:
        assert c.health() == c.health()
        h = c.health()
        assert (h.ok, h.prefill_workers, h.decode_workers) == (True, 2, 1)
        info = c.model_info()
        assert (info.model, info.vocab_size, info.eos_token_ids, info.has_tokenizer) == ("demo-small", 1024, (2,), True)
        s = c.stream([1], max_tokens=1000, request_id="a1")
        next(s)
        assert c.abort("a1") is True
        assert list(s)[-1].finish_reason == "abort"
        assert c.abort("never-seen") is False


def test_unary_calls_retry_unavailable(router):
    router.unavailable_first = 2
    with Client(router.addr, backoff=0.01) as c:
        assert c.health().ok
    assert router.calls["Health"] == 3


def test_api_key_metadata(router):
    router.required_key = "secret"
    with Client(router.addr, api_key="secret") as c:
        assert c.generate([1], max_tokens=1).completion_tokens == 1
        assert c.health().ok
    assert router.authorization == ["Bearer secret", "Bearer secret"]
    with Client(router.addr, backoff=0.01) as c, pytest.raises(UnauthenticatedError):
        c.health()
    assert router.authorization[-1] is None and router.calls["Health"] == 2


def test_retries_reach_a_router_that_comes_up_late():
    # The channel's own reconnect backoff (1 s at first) must not outlast the client's retries.
    servicer, port = FakeRouter(), _free_port()
    servers: list[grpc.Server] = []
    timer = threading.Timer(0.2, lambda: servers.append(_serve(servicer, f"127.0.0.1:{port}")))
    timer.start()
    try:
        with Client(f"127.0.0.1:{port}", retries=4, backoff=0.05) as c:
            assert c.generate([3], max_tokens=2).token_ids == tuple(fake_tokens([3], 2))
    finally:
        timer.join()
        for s in servers:
            s.stop(grace=None)


def test_importing_the_client_imports_no_torch():
    code = "import sys, baton.client, baton.cli.client_cmd; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# ---- asyncio client ---------------------------------------------------------------------------------------


def test_async_generate_stream_and_unary(router):
    async def main() -> None:
        async with AsyncClient(router.addr) as c:
            done = await c.generate([1, 2, 3], max_tokens=5)
            chunks = [ch async for ch in c.stream([1, 2, 3], max_tokens=5)]
            assert done.token_ids == tuple(t for ch in chunks for t in ch.token_ids) == tuple(fake_tokens([1, 2, 3], 5))
            assert (done.finish_reason, chunks[-1].finish_reason, done.completion_tokens) == ("length", "length", 5)
            assert (done.num_drafted_tokens, done.num_accepted_tokens) == (6, 2)
            assert (await c.health()).decode_workers == 1
            assert (await c.model_info()).layer_pattern == "M*M-"
            assert await c.abort("never-seen") is False

    asyncio.run(main())


def test_async_retries_and_errors(router):
    async def main() -> None:
        async with AsyncClient(router.addr, retries=3, backoff=0.01) as c:
            router.unavailable_first = 2
            assert (await c.generate([4], max_tokens=2)).token_ids == tuple(fake_tokens([4], 2))
            assert router.calls["Generate"] == 3
            router.unavailable_first = 2
            assert (await c.health()).ok and router.calls["Health"] == 3
            with pytest.raises(InvalidArgumentError):
                await c.generate([1], max_tokens=0)
            assert router.calls["Generate"] == 4
            router.fail_after = 1
            with pytest.raises(UnavailableError):
                await c.generate([5], max_tokens=8)
            assert router.calls["Generate"] == 5

    asyncio.run(main())


def test_async_early_close_cancels_the_call(router):
    router.token_delay = 0.02

    async def main() -> None:
        async with AsyncClient(router.addr, api_key="k") as c:
            s = c.stream([1], max_tokens=1000, request_id="early")
            first = await anext(s)
            assert first.request_id == "early"
            await s.aclose()
            assert [ch async for ch in s] == []
            assert await asyncio.to_thread(router.cancel_seen.wait, 5)

    asyncio.run(main())
    assert router.cancelled == ["early"] and router.authorization == ["Bearer k"]


# ---- baton client generate --------------------------------------------------------------------------------


def _cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="baton")
    client_cmd.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["client", "generate", *argv])
    return args.run(args)


def test_cli_prints_json_lines_in_input_order(router, capsys):
    # The first prompt finishes last; all three must be in flight at once (the router holds each stream until
    # the third arrives, so a slow machine cannot finish one before the CLI sends the next).
    router.gather = 3
    router.first_delay = lambda prompt: {9: 0.3, 4: 0.15}.get(prompt[0], 0.0)
    rc = _cli("--addr", router.addr, "--prompt-ids", "9 8 7", "--prompt", "hi", "--prompt-ids", "4",
              "--max-tokens", "3", "--json")
    out = capsys.readouterr().out.splitlines()
    assert rc == 0
    assert router.finished_order == [[104, 105], [4], [9, 8, 7]]
    assert router.peak_inflight == 3
    hi = fake_tokens([104, 105], 3)
    spec = fake_spec(2, 3)  # 2 + 1 tokens in 2 messages
    assert spec == {"drafted": 4, "accepted": 1}
    assert [json.loads(line) for line in out] == [
        {"prompt_ids": [9, 8, 7], "token_ids": fake_tokens([9, 8, 7], 3), "finish_reason": "length", "spec": spec},
        {"prompt": "hi", "token_ids": hi, "text": "".join(f"<{t}>" for t in hi), "finish_reason": "length",
         "spec": spec},
        {"prompt_ids": [4], "token_ids": fake_tokens([4], 3), "finish_reason": "length", "spec": spec},
    ]
    # Exactly the keys and order `baton generate --json` prints.
    assert out[0].startswith('{"prompt_ids": [9, 8, 7], "token_ids": [')


def test_cli_text_output_and_sampling_flags(router, capsys):
    stop = fake_tokens([1, 2], 4)[1]
    assert _cli("--addr", router.addr, "--prompt-ids", "1 2", "--max-tokens", "4", "--stop-token-ids", str(stop)) == 0
    assert capsys.readouterr().out == f"[1, 2] -> {fake_tokens([1, 2], 2)} (stop)\n"


def test_cli_sends_the_logits_processing_flags(router, capsys):
    assert _cli("--addr", router.addr, "--prompt-ids", "1 2", "--max-tokens", "4", "--min-p", "0.25",
                "--presence-penalty", "0.5", "--frequency-penalty", "-1", "--repetition-penalty", "1.5",
                "--logit-bias", "5:-100 7:2.5", "--min-tokens", "2") == 0
    sp = router.samplings[-1]
    assert (sp.min_p, sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty, dict(sp.logit_bias),
            sp.min_tokens) == (0.25, 0.5, -1.0, 1.5, {5: -100.0, 7: 2.5}, 2)
    assert _cli("--addr", router.addr, "--prompt-ids", "1", "--max-tokens", "4") == 0
    plain = router.samplings[-1]
    assert not any(plain.HasField(f) for f in ("min_p", "presence_penalty", "repetition_penalty", "min_tokens"))
    capsys.readouterr()


def test_cli_errors(router, capsys):
    assert _cli("--addr", router.addr, "--prompt-ids", "1", "--max-tokens", "0") == 2
    out, err = capsys.readouterr()
    assert out == "" and "INVALID_ARGUMENT: max_tokens must be >= 1" in err and "Traceback" not in err
    assert _cli("--addr", router.addr) == 2
    assert "at least one" in capsys.readouterr().err
    assert _cli("--addr", f"127.0.0.1:{_free_port()}", "--prompt-ids", "1", "--timeout", "5") == 1
    assert "UNAVAILABLE" in capsys.readouterr().err


def test_sdk_ships_its_type_hints():
    # PEP 561: type checkers read the SDK's annotations only if the installed package carries py.typed.
    import importlib.resources

    assert importlib.resources.files("baton.client").joinpath("py.typed").is_file()
