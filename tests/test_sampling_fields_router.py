"""The sampling fields through the router, over fake workers: gRPC's new SamplingParams fields reach the decode node
(and bad values are INVALID_ARGUMENT naming the field), `n` fans out into n requests with per-choice seeds (one
stream whose messages carry their choice's index; Abort ends them all), stop strings end a gRPC stream with the
match left out, and the OpenAI front returns n choices per prompt with indexes, per-choice seeds and summed usage."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from baton.proto.v1 import generation_pb2
from baton.router.choices import MAX_CHOICES, choice_seed, fan_out
from tests.test_openai_http import fake_front, tok_dir  # noqa: F401  (fixture)
from tests.test_router_fakes import VOCAB, cluster, eventually, expected_tokens, run, tokens_of

FIELDS = dict(max_tokens=6, min_p=0.25, presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.25,
              logit_bias={7: 3.5, 9: -100.0}, min_tokens=2)


def test_grpc_sampling_fields_reach_the_decode_node_and_bad_ones_are_named():
    async def go():
        async with cluster() as c:
            msgs = await c.generate([5, 6, 7], **FIELDS)
            assert tokens_of(msgs) == expected_tokens([5, 6, 7], 6)
            sent = c.decode[0].decodes[-1].sampling
            assert (sent.min_p, sent.presence_penalty, sent.frequency_penalty, sent.repetition_penalty,
                    dict(sent.logit_bias), sent.min_tokens) == (0.25, 0.5, -1.0, 1.25, {7: 3.5, 9: -100.0}, 2)
            for bad, name in [({"presence_penalty": 2.5}, "presence_penalty"), ({"min_p": 1.5}, "min_p"),
                              ({"repetition_penalty": 0.0}, "repetition_penalty"),
                              ({"logit_bias": {VOCAB: 1.0}}, "logit_bias"), ({"logit_bias": {3: 150.0}}, "logit_bias"),
                              ({"max_tokens": 3, "min_tokens": 4}, "min_tokens")]:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await c.generate([5, 6, 7], **bad)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and f"'{name}'" in e.value.details()
    run(go())


def test_choice_seeds_are_distinct_reproducible_and_valid():
    seeds = [choice_seed(7, i) for i in range(64)]
    assert seeds[0] == 7 and len(set(seeds)) == 64 and all(0 <= s < 2**63 for s in seeds)
    assert seeds == [choice_seed(7, i) for i in range(64)]
    assert choice_seed(8, 1) != seeds[1]
    req = generation_pb2.GenerateRequest(request_id="r", n=3, sampling=generation_pb2.SamplingParams(seed=7))
    out = fan_out(req, 3)
    assert [r.request_id for r in out] == ["r", "r/1", "r/2"] and [r.n for r in out] == [0, 0, 0]
    assert [r.sampling.seed for r in out] == seeds[:3]
    unseeded = fan_out(generation_pb2.GenerateRequest(n=2), 2)
    assert not any(r.sampling.HasField("seed") for r in unseeded)


def test_grpc_n_streams_every_choice_with_its_index_and_seed():
    async def go():
        async with cluster() as c:
            req = generation_pb2.GenerateRequest(request_id="r", n=3, token_ids=generation_pb2.TokenIds(ids=[4, 5]),
                                                 sampling=generation_pb2.SamplingParams(max_tokens=4, seed=11))
            msgs = [m async for m in c.stub.Generate(req, timeout=10)]
            assert {m.request_id for m in msgs} == {"r"}
            for i in range(3):
                mine = [m for m in msgs if m.index == i]
                assert tokens_of(mine) == expected_tokens([4, 5], 4)
                assert mine[-1].finish_reason == generation_pb2.FINISH_REASON_LENGTH
                assert mine[-1].usage.completion_tokens == 4
            seeds = sorted(d.sampling.seed for d in c.decode[0].decodes)
            assert seeds == sorted(choice_seed(11, i) for i in range(3))
            req.n = MAX_CHOICES + 1
            with pytest.raises(grpc.aio.AioRpcError) as e:
                _ = [m async for m in c.stub.Generate(req, timeout=10)]
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n: expected at most" in e.value.details()
            # A choice refused (each is validated as a request) ends the call with its status.
            bad = generation_pb2.GenerateRequest()
            bad.CopyFrom(req)
            bad.n, bad.sampling.presence_penalty = 3, 9.0
            with pytest.raises(grpc.aio.AioRpcError) as e:
                _ = [m async for m in c.stub.Generate(bad, timeout=10)]
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'presence_penalty'" in e.value.details()
            assert not c.router.service._fans and not c.router.service._inflight
            # Abort by the request's id ends every choice on the node.
            c.decode[0].token_delay_s = 0.05
            req.n, req.request_id = 3, "q"
            call = c.stub.Generate(req, timeout=10)
            await eventually(lambda: len(c.decode[0].active) == 3, what="three choices decoding")
            assert (await c.stub.Abort(generation_pb2.AbortRequest(request_id="q"))).found
            msgs = [m async for m in call]
            assert {m.index for m in msgs if m.finish_reason == generation_pb2.FINISH_REASON_ABORT} == {0, 1, 2}
            assert {m.request_id for m in msgs} == {"q"}
            assert {"q", "q/1", "q/2"} <= set(c.decode[0].aborts), c.decode[0].aborts
    run(go())


def test_grpc_stop_strings_cut_the_text_before_the_match_and_end_the_request(tok_dir):  # noqa: F811
    from baton.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(tok_dir)
    reply = "Hello world. Goodbye now"

    async def go():
        async with cluster(tokenizer_path=str(tok_dir / "tokenizer.json")) as c:
            d0 = c.decode[0]
            d0.script = tok.encode(reply)
            d0.token_delay_s = 0.02  # the stop must catch the request while it still runs
            req = generation_pb2.GenerateRequest(request_id="s", text="Say hi", stop=["d. G", "zz"],
                                                 sampling=generation_pb2.SamplingParams(max_tokens=50))
            msgs = [m async for m in c.stub.Generate(req, timeout=10)]
            assert "".join(m.text for m in msgs) == "Hello worl"
            assert msgs[-1].finish_reason == generation_pb2.FINISH_REASON_STOP
            assert msgs[-1].usage.completion_tokens < len(d0.script)
            await eventually(lambda: "s" in d0.aborts, what="abort after the stop string")
            assert c.router.service.metrics.registry.get_sample_value(
                "baton_router_requests_total", {"outcome": "ok"}) == 1
    run(go())

    async def without_tokenizer():
        async with cluster() as c:
            req = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[3]), stop=["x"])
            with pytest.raises(grpc.aio.AioRpcError) as e:
                _ = [m async for m in c.stub.Generate(req, timeout=10)]
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("stop: ")
    run(without_tokenizer())


def test_http_n_returns_n_choices_per_prompt_with_indexes_seeds_and_summed_usage():
    async def go():
        async with fake_front() as env:
            c = env.client
            out = await c.completions.create(model="fake", prompt=[[5, 6], [8, 9, 10]], max_tokens=3, n=2, seed=5,
                                             extra_body={"return_token_ids": True, "presence_penalty": 0.5})
            assert [ch.index for ch in out.choices] == [0, 1, 2, 3]
            assert [ch.model_dump()["token_ids"] for ch in out.choices] == [
                expected_tokens([5, 6], 3)] * 2 + [expected_tokens([8, 9, 10], 3)] * 2
            assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (2 + 2 + 3 + 3, 12)
            sent = env.decode.decodes[-4:]
            by_prompt = {}
            for d in sent:
                by_prompt.setdefault(tuple(d.prompt_token_ids), []).append(d.sampling.seed)
                assert d.sampling.presence_penalty == 0.5
            assert all(sorted(s) == sorted([5, choice_seed(5, 1)]) for s in by_prompt.values())
            stream = await c.completions.create(model="fake", prompt=[5, 6], max_tokens=3, n=3, stream=True,
                                                stream_options={"include_usage": True})
            chunks = [ch async for ch in stream]
            finals = sorted(ch.choices[0].index for ch in chunks if ch.choices and ch.choices[0].finish_reason)
            assert finals == [0, 1, 2] and chunks[-1].usage.completion_tokens == 9
            await asyncio.sleep(0)
    run(go())


def test_the_sdk_sends_the_fields_and_collects_n_choices():
    from baton.client import AsyncClient

    async def go():
        async with cluster() as c, AsyncClient(f"127.0.0.1:{c.router.port}", retries=0) as client:
            out = await client.generate([4, 5], n=3, seed=2, **FIELDS)
            assert [ch.index for ch in out.choices] == [0, 1, 2]
            assert all(ch.token_ids == tuple(expected_tokens([4, 5], 6)) for ch in out.choices)
            assert out.token_ids == out.choices[0].token_ids and out.completion_tokens == 18
            sent = [d.sampling for d in c.decode[0].decodes]
            assert sorted(s.seed for s in sent) == sorted(choice_seed(2, i) for i in range(3))
            assert all(dict(s.logit_bias) == {7: 3.5, 9: -100.0} and s.min_tokens == 2 for s in sent)
            chunks = [ch async for ch in client.stream([4, 5], n=2, max_tokens=2)]
            assert sorted(ch.index for ch in chunks if ch.finish_reason) == [0, 1]
    run(go())
