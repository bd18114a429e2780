"""The router's side of logprobs (over fake nodes): token logprobs are forwarded with their tokens; a disaggregated
request's prompt logprobs come from its prefill node (asked in the Prefill call, left out of the Decode call, whose
node computes token N only), also when the pull fails and the decode node recomputes; a request prefilled on the
decode node gets that node's; bounds are INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import grpc
import pytest

from tests.test_router_fakes import DECODE_LOGPROB, PREFILL_LOGPROB, cluster, run, tokens_of

PROMPT = [5, 6, 7, 8]


def prompt_logprobs(msgs) -> list[tuple[int, float, int]]:
    return [(x.token_id, x.logprob, len(x.top)) for m in msgs for x in m.prompt_logprobs]


def test_token_logprobs_travel_with_their_tokens():
    async def go():
        async with cluster() as c:
            msgs = await c.generate(PROMPT, max_tokens=4, logprobs=2)
            assert [len(m.logprobs) for m in msgs] == [len(m.token_ids) for m in msgs]
            assert [x.token_id for m in msgs for x in m.logprobs] == tokens_of(msgs)
            assert [x.logprob for m in msgs for x in m.logprobs] == [-1.0, -2.0, -3.0, -4.0]
            assert not any(m.prompt_logprobs for m in msgs)
            plain = await c.generate(PROMPT, max_tokens=4)
            assert not any(m.logprobs for m in plain)
    run(go())


@pytest.mark.parametrize("path", ["disaggregated", "pull fails", "prefill fails", "one-token prompt"])
def test_prompt_logprobs_come_from_the_node_that_scored_the_prompt(path):
    prompt = PROMPT[:1] if path == "one-token prompt" else PROMPT

    def configure(c):
        c.decode[0].pull_fails = path == "pull fails"
        c.prefill[0].prefill_failures = -1 if path == "prefill fails" else 0

    async def go():
        async with cluster(configure=configure) as c:
            msgs = await c.generate(prompt, max_tokens=3, prompt_logprobs=2)
            (decode,) = c.decode[0].decodes
            by_prefill = path in ("disaggregated", "pull fails")
            value = PREFILL_LOGPROB if by_prefill else DECODE_LOGPROB
            assert prompt_logprobs(msgs[:1]) == [(t, value, 2) for t in prompt[1:]]
            assert not prompt_logprobs(msgs[1:])
            # The Decode call asks for them only where its node prefills the prompt.
            assert decode.sampling.HasField("prompt_logprobs") == (not decode.HasField("handle"))
            assert decode.HasField("handle") == by_prefill
            if by_prefill:
                assert c.prefill[0].prefills[-1].prompt_logprobs == 2
    run(go())


def test_logprobs_beyond_the_routers_bound_are_refused():
    async def go():
        async with cluster(max_logprobs=3) as c:
            for name in ("logprobs", "prompt_logprobs"):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await c.generate(PROMPT, **{name: 4})
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert f"sampling.{name}: expected at most 3" in e.value.details()
            assert not c.decode[0].decodes and not c.prefill[0].prefills
            await c.generate(PROMPT, max_tokens=1, logprobs=3, prompt_logprobs=3)
    run(go())
