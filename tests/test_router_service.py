"""Generation service surface: validation (INVALID_ARGUMENT), Health and ModelInfo, workers taken out of and
put back into rotation, load spreading between polls, text prompts and text deltas."""

from __future__ import annotations

import asyncio
import re

import grpc
import pytest

from baton.engine import tokenizer_train
from baton.engine.tokenizer import load_tokenizer
from baton.proto.v1 import generation_pb2
from tests.test_router_fakes import MAX_MODEL_LEN, VOCAB, cluster, eventually, run, tokens_of


def _ids(*ids):
    return generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=ids))


@pytest.mark.parametrize(("request_", "match"), [
    (generation_pb2.GenerateRequest(), "prompt: expected token_ids or text, got neither"),
    (_ids(), "expected at least one token, got an empty prompt"),
    (_ids(1, VOCAB, 2), f"expected ids in \\[0, vocab_size={VOCAB}\\), got \\[{VOCAB}\\]"),
    (_ids(*range(MAX_MODEL_LEN)), f"fewer than max_model_len={MAX_MODEL_LEN} tokens, got {MAX_MODEL_LEN}"),
    (generation_pb2.GenerateRequest(text="hello"), "no tokenizer"),
    (generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[1]),
                                    sampling=generation_pb2.SamplingParams(temperature=-1)), "temperature"),
    (generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[1]),
                                    sampling=generation_pb2.SamplingParams(max_tokens=0)), "max_tokens"),
    (generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[1]),
                                    sampling=generation_pb2.SamplingParams(top_p=0)), "top_p"),
    (generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[1]),
                                    sampling=generation_pb2.SamplingParams(seed=2**63)), "seed"),
    (generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[1]),
                                    sampling=generation_pb2.SamplingParams(stop_token_ids=[VOCAB])),
     "stop_token_ids"),
    (generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[1]),
                                    sampling=generation_pb2.SamplingParams(max_tokens=2**32 - 1)),
     f"sampling.max_tokens: expected at most max_model_len={MAX_MODEL_LEN}, got {2**32 - 1}"),
    (generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[1]),
                                    sampling=generation_pb2.SamplingParams(top_k=VOCAB + 1)),
     f"sampling.top_k: expected at most vocab_size={VOCAB}"),
    (generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[1]),
                                    sampling=generation_pb2.SamplingParams(temperature=float("nan"))), "temperature"),
    (generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[1]),
                                    sampling=generation_pb2.SamplingParams(top_p=float("inf"))), "top_p"),
    (generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[1]),
                                    sampling=generation_pb2.SamplingParams(stop_token_ids=[1] * 257)),
     "sampling.stop_token_ids: expected at most 256 ids \\(--max-stop-ids\\), got 257"),
    (generation_pb2.GenerateRequest(request_id="x" * 257, token_ids=generation_pb2.TokenIds(ids=[1])),
     "request_id: expected at most 256 characters, got 257"),
])
def test_invalid_requests_are_rejected_before_any_worker_sees_them(request_, match):
    async def go():
        async with cluster(1, 1) as c:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in c.stub.Generate(request_, timeout=5):
                    pass
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert re.search(match, e.value.details()), e.value.details()
            assert c.prefill[0].prefills == [] and c.decode[0].decodes == []
    run(go())


def test_health_and_model_info():
    async def go():
        async with cluster(2, 1) as c:
            h = await c.health()
            assert (h.ok, h.prefill_workers, h.decode_workers) == (True, 2, 1)
            info = await c.stub.ModelInfo(generation_pb2.ModelInfoRequest())
            assert (info.model, info.vocab_size, info.max_model_len, list(info.eos_token_ids)) == \
                ("fake", VOCAB, MAX_MODEL_LEN, [2])
            assert not info.has_tokenizer
    run(go())


def test_router_starts_before_its_workers_answer():
    async def go():
        async with cluster(1, 1, configure=lambda c: setattr(c.decode[0], "load_fails", True)) as c:
            h = await c.health()
            assert (h.ok, h.decode_workers, h.prefill_workers) == (False, 0, 1)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.generate([1, 2])
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "model" in e.value.details()
            c.decode[0].load_fails = False
            await eventually(lambda: c.router.service.decode_pool.healthy_count() == 1, what="decode healthy")
            assert (await c.health()).ok
            assert tokens_of(await c.generate([1, 2]))
    run(go())


def test_unhealthy_workers_leave_rotation_and_come_back():
    async def go():
        async with cluster(2, 2) as c:
            svc = c.router.service
            (p0, p1), (d0, d1) = c.prefill, c.decode
            p1.load_fails = d1.load_fails = True
            await eventually(lambda: svc.prefill_pool.healthy_count() == 1 and svc.decode_pool.healthy_count() == 1,
                             what="workers marked unhealthy")
            h = await c.health()
            assert (h.ok, h.prefill_workers, h.decode_workers) == (True, 1, 1)
            for i in range(8):
                await c.generate(list(range(i, i + 5)), max_tokens=2)
            assert (len(p0.prefills), len(p1.prefills), len(d0.decodes), len(d1.decodes)) == (8, 0, 8, 0)
            # Back: and looking emptier than the others, so two choices now pick them.
            p1.load_fails = d1.load_fails = False
            p0.outstanding_prefill_tokens, d0.free_state_slots = 1000, 1
            await eventually(lambda: svc.prefill_pool.healthy_count() == 2 and svc.decode_pool.healthy_count() == 2,
                             what="workers back in rotation")
            await c.generate(list(range(5)), max_tokens=2)
            assert (len(p1.prefills), len(d1.decodes)) == (1, 1)
            # With every decode worker down, Health says so and requests fail clearly.
            d0.load_fails = d1.load_fails = True
            await eventually(lambda: svc.decode_pool.healthy_count() == 0, what="no decode worker")
            assert not (await c.health()).ok
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.generate([1])
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    run(go())


def test_a_stopped_node_is_taken_out_and_requests_still_succeed():
    async def go():
        async with cluster(2, 1) as c:
            svc = c.router.service
            await c.servers["p0"].stop(0)
            prompt = list(range(20))
            for _ in range(3):  # before the poll notices, a request may still pick p0: retry saves it
                assert tokens_of(await c.generate(prompt, max_tokens=3))
            await eventually(lambda: svc.prefill_pool.healthy_count() == 1, what="p0 out of rotation")
            assert all(d.handle.engine_id == "p1" for d in c.decode[0].decodes)
    run(go())


def test_bookkeeping_spreads_requests_between_polls():
    async def go():
        # Polls are rare here: only the router's own count of work in flight can spread these.
        async with cluster(2, 2, load_poll_interval_s=30.0) as c:
            for w in c.prefill:
                w.prefill_delay_s = 0.3
            for w in c.decode:
                w.token_delay_s = 0.02
            await asyncio.gather(*(c.generate(list(range(10)), max_tokens=3) for _ in range(8)))
            # Two workers: both are always sampled, the lower load wins, so the split is exact.
            assert [len(p.prefills) for p in c.prefill] == [4, 4]
            assert [len(d.decodes) for d in c.decode] == [4, 4]
    run(go())


def test_text_prompt_and_text_deltas(tmp_path):
    tokenizer_train.write_tokenizer(tmp_path, {"vocab_size": VOCAB, "pad_token_id": 0, "bos_token_id": 1,
                                               "eos_token_id": 2})
    tok = load_tokenizer(tmp_path)
    text = "naïve café — 東京 🙂 done"
    ids = tok.encode(text)
    assert any(tok.decode([i]).endswith("\ufffd") for i in ids)  # some characters span several tokens

    async def go():
        async with cluster(1, 1, tokenizer_path=str(tmp_path / "tokenizer.json")) as c:
            c.decode[0].script = ids
            assert (await c.stub.ModelInfo(generation_pb2.ModelInfoRequest())).has_tokenizer
            req = generation_pb2.GenerateRequest(text="def f(x):\n    return x")
            msgs = [m async for m in c.stub.Generate(req, timeout=5)]
            assert list(c.decode[0].decodes[0].prompt_token_ids) == tok.encode("def f(x):\n    return x")
            assert tokens_of(msgs) == ids
            deltas = [m.text for m in msgs]
            assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)
    run(go())


def varint(n: int) -> bytes:
    out = b""
    while True:
        low, n = n & 0x7F, n >> 7
        if not n:
            return out + bytes([low])
        out += bytes([low | 0x80])


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (a submessage or a packed list)."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


# token_ids (field 2) holding one packed id of 2**40 + 7, which protobuf's parser would truncate to 7.
WIDE_TOKEN_ID = _field(2, _field(1, varint(2**40 + 7)))
# sampling (field 4) with max_tokens (field 1) of 2**33.
WIDE_MAX_TOKENS = _field(4, varint(1 << 3) + varint(2**33)) + _field(2, _field(1, varint(5)))
# sampling (field 4) with a field 9 that SamplingParams does not declare (a newer client's, say min_p).
UNKNOWN_SAMPLING_FIELD = _field(4, varint(9 << 3) + varint(1)) + _field(2, _field(1, varint(5)))


@pytest.mark.parametrize(("method", "streaming", "raw", "match"), [
    ("Generate", True, b"\xff\xff\xff\xff", "expected a serialized baton.v1.GenerateRequest"),
    ("Generate", True, b"\x12\x05\x0a", "expected a serialized baton.v1.GenerateRequest"),
    ("Generate", True, WIDE_TOKEN_ID,
     f"baton.v1.GenerateRequest.token_ids.ids: expected integers in \\[0, {2**32}\\), got {2**40 + 7}"),
    ("Generate", True, WIDE_MAX_TOKENS, f"sampling.max_tokens: expected integers in \\[0, {2**32}\\), got {2**33}"),
    ("Generate", True, UNKNOWN_SAMPLING_FIELD,
     "baton.v1.GenerateRequest.sampling.field number 9 is not implemented by this server"),
    ("Abort", False, varint(7 << 3) + varint(1), "baton.v1.AbortRequest.field number 7 is not implemented"),
    ("Abort", False, b"\x0a\xff", "expected a serialized baton.v1.AbortRequest"),
    ("ModelInfo", False, b"\x08", "expected a serialized baton.v1.ModelInfoRequest"),
])
def test_undecodable_too_wide_or_unknown_fields_are_invalid_argument(method, streaming, raw, match):
    async def go():
        async with cluster(1, 1) as c:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{c.router.port}") as ch:
                path = f"/baton.v1.Generation/{method}"
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    if streaming:
                        async for _ in ch.unary_stream(path)(raw, timeout=5):
                            pass
                    else:
                        await ch.unary_unary(path)(raw, timeout=5)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert re.search(match, e.value.details()), e.value.details()
            assert c.decode[0].decodes == []
            # The router still serves.
            assert tokens_of(await c.generate([1, 2]))
    run(go())


def test_stop_id_count_follows_the_flag():
    async def go():
        async with cluster(1, 1, max_stop_ids=2) as c:
            assert tokens_of(await c.generate([1, 2], stop_token_ids=[3, 4]))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.generate([1, 2], stop_token_ids=[3, 4, 5])
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "--max-stop-ids" in e.value.details()
    run(go())
