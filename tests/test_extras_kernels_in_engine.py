"""The sampling extras' Triton kernels in the engine: with `Kernels.process_logits` and `logprob_pack` the Triton
ones (the model's ops the references), requests with penalties, logit_bias, min_tokens, min_p, logprobs and prompt
logprobs, greedy and seeded, with K = 0 and K = 2 drafts, get the references' tokens and logprobs (within float32
rounding), and every processing and logprob call went through the kernels. The model: test_logprobs.py's `tiny`
preset with one MTP layer and an 8-token vocabulary. On CPU the kernels run in Triton's interpreter."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first import of triton

import dataclasses  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (the Makefile's CPU install lacks it)")

from baton.engine import llm_engine  # noqa: E402
from baton.engine.loader import load_checkpoint  # noqa: E402
from baton.engine.make_model import make_model  # noqa: E402
from baton.engine.ops.kernels import resolve_kernels  # noqa: E402
from baton.engine.sampling_params import SamplingParams  # noqa: E402
from tests.test_logprobs import PROMPTS, VOCAB, collect, engine_of  # noqa: E402

PARAMS = [
    SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3, presence_penalty=0.5, repetition_penalty=1.3),
    SamplingParams(max_tokens=6, ignore_eos=True, temperature=1.0, seed=7, min_p=0.2, frequency_penalty=0.4,
                   logprobs=2, prompt_logprobs=2, logit_bias={3: 1.5}),
    SamplingParams(max_tokens=6, ignore_eos=True),
    SamplingParams(max_tokens=6, min_tokens=3, temperature=0.8, seed=3, logprobs=0),
]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = make_model(tmp_path_factory.mktemp("xk") / "m", "tiny", mtp_layers=1, seed=5, progress=False,
                     overrides={"vocab_size": VOCAB, "hybrid_override_pattern": "M*-", "mamba_num_heads": 4},
                     tokenizer=False, dtype="float32")
    return load_checkpoint(out), None


@pytest.mark.interpreter
@pytest.mark.parametrize("k", [0, 2])
def test_extras_on_the_triton_kernels_equal_the_references(model, k, monkeypatch):
    ref = collect(engine_of(model, k, kernels="torch"), PROMPTS, PARAMS)
    triton_kernels = resolve_kernels("triton", "cpu")
    calls: list[str] = []

    def spied(name):
        fn = getattr(triton_kernels, name)

        def spy(*args, **kw):
            calls.append(name)
            return fn(*args, **kw)
        return spy
    kernels = dataclasses.replace(resolve_kernels("torch", "cpu"), process_logits=spied("process_logits"),
                                  logprob_pack=spied("logprob_pack"))
    monkeypatch.setattr(llm_engine, "resolve_kernels", lambda mode, device: kernels)
    got = collect(engine_of(model, k, kernels="torch"), PROMPTS, PARAMS)
    assert set(calls) == {"process_logits", "logprob_pack"}
    for r, ((tokens, lps, plps), (want_tokens, want_lps, want_plps)) in enumerate(zip(got, ref, strict=True)):
        assert tokens == want_tokens, r
        for a, b in zip([*lps, *(plps or ())], [*want_lps, *(want_plps or ())], strict=True):
            if b is None:
                assert a is None
                continue
            assert (a.token_id, [t for t, _ in a.top]) == (b.token_id, [t for t, _ in b.top]), r
            torch.testing.assert_close(torch.tensor([a.logprob, *(v for _, v in a.top)]),
                                       torch.tensor([b.logprob, *(v for _, v in b.top)]), atol=2e-6, rtol=0)
