"""The penalties' device-resident inputs (`penalty_counts`): per state slot, the generated-token counts and the prompt's
token bits, set from the host history when a request enters a slot it does not own and then grown by every step from
the tokens it decides.

Checked: the resident inputs process logits exactly as the host lists do; a slot is set once per owner; and in the
engine (the tiny preset with an 8-token vocabulary and one MTP layer), with penalties on some rows only, greedy
outputs equal a step-by-step torch reference from the raw logits with K = 0 and K = 2 drafts under async scheduling,
with preemption by recompute (a small KV pool), and when a finished request's slot (and id) goes to a new penalised
request; after every step each penalised running request's counts are its host outputs (with K = 0 plus the token of
the step in flight)."""

from __future__ import annotations

import functools

import pytest
import torch

from baton.engine.logits_processing import (
    RowHistory,
    allowed_tokens,
    apply_processing,
    count_decided,
    logits_inputs,
)
from baton.engine.penalty_counts import PenaltyCounts
from baton.engine.request import PENDING, RequestStatus
from baton.engine.sampling_params import SamplingParams
from tests.test_engine_processing import _raw_logits
from tests.test_logits_processing import PARAMS, _histories, reference
from tests.test_spec_decode import new_engine, run, small_spec_model  # noqa: F401  (fixture)

CPU = torch.device("cpu")


@pytest.mark.parametrize("K", [0, 3])
def test_resident_counts_process_the_logits_as_the_host_lists_do(K):
    g = torch.Generator().manual_seed(1)
    V, R = 12, len(PARAMS)
    hist = _histories(g, V)
    logits = torch.randn(R, K + 1, V, generator=g) * 3
    drafts = torch.randint(V, (R, K), generator=g)
    num_draft = torch.tensor([min(K, r % 4) for r in range(R)])
    pc = PenaltyCounts(8, V, CPU)
    slots = [3, 0, 5, 1, 7, 2]
    owners = [i if p.penalised else None for i, p in enumerate(PARAMS)]
    resident = pc.resident(slots, owners, hist, [p.repetition_penalty != 1 for p in PARAMS])
    host = apply_processing(logits, drafts, num_draft, logits_inputs(PARAMS, hist, CPU))
    inputs = logits_inputs(PARAMS, hist, CPU, resident=resident)
    assert inputs.gen.shape[1] == 0 and inputs.prompt.shape[1] == 0  # nothing of the history travelled
    assert torch.equal(apply_processing(logits, drafts, num_draft, inputs), host)
    # The tokens a step decides grow the penalised rows' counts only (-1: a verify position past its tokens).
    tokens = torch.randint(V, (R, K + 1), generator=g)
    tokens[:, -1] = -1
    count_decided(inputs, tokens)
    for r, (p, h) in enumerate(zip(PARAMS, hist, strict=True)):
        row = pc.counts[slots[r]]
        want = [*h.outputs, *tokens[r, :K].tolist()] if p.penalised else []
        assert torch.equal(row, torch.bincount(torch.tensor(want, dtype=torch.int64), minlength=V).int()), r
    assert not pc.counts[pc.num_slots].any() and not pc.prompt_bits[pc.num_slots].any()


def test_a_slot_is_set_once_per_owner_and_from_scratch_for_a_new_one():
    V = 70
    pc = PenaltyCounts(4, V, CPU)
    p = SamplingParams(max_tokens=8, frequency_penalty=1.0, repetition_penalty=1.2)
    outs = [2, 2]
    first = pc.resident([1], [10], [RowHistory([0, 31, 32, 69], outs, frozenset())], [True])
    assert torch.equal(allowed_tokens(pc.prompt_bits[1], V).nonzero().flatten(), torch.tensor([0, 31, 32, 69]))
    count_decided(logits_inputs([p], [RowHistory([0], outs, frozenset())], CPU, resident=first), torch.tensor([4]))
    outs.append(PENDING)  # the step's token, not read yet: the same owner's counts are not set again
    pc.resident([1], [10], [RowHistory([0, 31, 32, 69], outs, frozenset())], [True])
    assert pc.counts[1, :5].tolist() == [0, 0, 2, 0, 1]
    with pytest.raises(RuntimeError, match="not read yet"):
        pc.resident([1], [11], [RowHistory([5], outs, frozenset())], [True])
    pc.resident([1], [11], [RowHistory([5], [], frozenset())], [False])  # a new owner starts from nothing
    assert not pc.counts[1].any() and not pc.prompt_bits[1].any()
    with pytest.raises(ValueError, match="one per row"):
        pc.resident([1, 2], [12], [None], [False])


# Penalised rows (a, c), a processed row without penalties (d) and a plain one (b); greedy, so that a step-by-step
# reference decides every token.
PARAMS_BY_ID = {
    "a": SamplingParams(max_tokens=10, ignore_eos=True, repetition_penalty=1.8, frequency_penalty=0.7),
    "b": SamplingParams(max_tokens=10, ignore_eos=True),
    "c": SamplingParams(max_tokens=10, ignore_eos=True, presence_penalty=1.5, repetition_penalty=0.6),
    "d": SamplingParams(max_tokens=10, ignore_eos=True, logit_bias={3: 1.5}),
}
PROMPTS = {"a": [1, 2, 3, 1, 2], "b": [7], "c": [4, 4, 4, 4, 4, 4, 4, 4, 4, 5, 6], "d": [2, 6, 2, 6, 5, 0, 1]}


@functools.cache
def _reference(model_key: int, rid: str, prompt: tuple[int, ...]) -> list[int]:
    """The greedy tokens of request `rid`'s params after `prompt`, one at a time: the raw logits of prompt + tokens
    so far, processed by test_logits_processing's per-row torch reference, argmax."""
    model = _MODELS[model_key]
    engine = _REF_ENGINES.setdefault(model_key, new_engine(model, 0, async_scheduling=False))
    p = PARAMS_BY_ID[rid]
    want: list[int] = []
    for _ in range(p.max_tokens):
        z = reference(_raw_logits(engine, [*prompt, *want]), p, list(prompt), want, set())
        want.append(int(z.argmax()))
    return want


_MODELS: dict[int, object] = {}
_REF_ENGINES: dict[int, object] = {}


def reference_tokens(model, rid: str, prompt: list[int]) -> list[int]:
    _MODELS[id(model)] = model
    return _reference(id(model), rid, tuple(prompt))


def check_counts(engine, checked: list[int]) -> None:
    """After a step: every running penalised request whose slot holds its counts has its outputs counted there, the
    PENDING ones (a step in flight's, K = 0) as some token each."""
    runner = engine.runner
    pc = runner.penalties
    for rid, owner in runner._penalised.items():
        req = engine.scheduler.requests.get(rid)
        if req is None or req.status is not RequestStatus.RUNNING or pc._owner.get(req.state_slot) != owner:
            continue
        outs = req.output_token_ids
        known = torch.tensor([t for t in outs if t != PENDING], dtype=torch.int64)
        extra = pc.counts[req.state_slot] - torch.bincount(known, minlength=pc.vocab_size)
        assert extra.min() >= 0 and extra.sum() == outs.count(PENDING), (rid, outs)
        checked.append(len(outs))


def _serve(engine, arrivals: list[list[str]], ids: dict[str, str] | None = None) -> tuple[dict, list[int]]:
    """Requests of PARAMS_BY_ID (arrivals[i]: added before step i, under `ids`' id), served with the counts checked
    after every step; (request id -> output, the output lengths checked)."""
    ids = ids or {}
    checked: list[int] = []
    waves = [[("local", ids.get(k, k), PROMPTS[k]) for k in wave] for wave in arrivals]
    params = {ids.get(k, k): PARAMS_BY_ID[k] for wave in arrivals for k in wave}
    done = run(engine, waves, params, after_step=lambda e: check_counts(e, checked))
    return done, checked


def _spy_sets(monkeypatch) -> list[int]:
    """The output counts of the histories `PenaltyCounts` sets slots from, as it sets them."""
    sets: list[int] = []
    real = PenaltyCounts._set

    def spy(self, slots, histories, repetition):
        sets.extend(len(h.outputs) for h in histories)
        return real(self, slots, histories, repetition)

    monkeypatch.setattr(PenaltyCounts, "_set", spy)
    return sets


@pytest.mark.parametrize("k", [0, 2])
def test_penalties_on_some_rows_equal_a_torch_reference_with_async_scheduling(small_spec_model, k,  # noqa: F811
                                                                              monkeypatch):
    sets = _spy_sets(monkeypatch)
    engine = new_engine(small_spec_model, k, async_scheduling=True)
    done, checked = _serve(engine, [["a", "b"], [], ["c", "d"]])
    for rid, prompt in PROMPTS.items():
        assert list(done[rid].token_ids) == reference_tokens(small_spec_model, rid, prompt), rid
    assert max(checked) >= 9  # the counts were checked up to the last steps
    if k:
        assert sum(o.num_accepted for o in done.values()) > 0  # verify positions after accepted drafts counted them
    assert sets == [0, 0]  # each penalised request's slot set once, at its first token (no preemption here)


@pytest.mark.parametrize("k", [0, 2])
def test_a_request_readmitted_after_preemption_gets_its_counts_again(small_spec_model, k, monkeypatch):  # noqa: F811
    sets = _spy_sets(monkeypatch)
    engine = new_engine(small_spec_model, k, async_scheduling=True, num_kv_blocks=11)
    done, _ = _serve(engine, [["d", "b", "c", "a"]])  # the penalised ones arrive last: preempted first
    assert engine.scheduler.num_preemptions > 0
    assert any(n > 0 for n in sets)  # a penalised request was readmitted with outputs, into a slot it did not own
    for rid, prompt in PROMPTS.items():
        assert list(done[rid].token_ids) == reference_tokens(small_spec_model, rid, prompt), rid


@pytest.mark.parametrize("k", [0, 2])
def test_a_finished_requests_slot_and_id_go_to_a_new_penalised_request_from_zero(small_spec_model, k):  # noqa: F811
    engine = new_engine(small_spec_model, k, async_scheduling=True, max_num_seqs=1)
    slots: list[int] = []
    real = engine.runner.penalties.resident

    def spy(s, *args):
        slots.extend(s)
        return real(s, *args)

    engine.runner.penalties.resident = spy
    first, _ = _serve(engine, [["a"]], {"a": "x"})
    second, checked = _serve(engine, [["c"]], {"c": "x"})
    assert set(slots) == {0}  # one slot, reused
    assert list(first["x"].token_ids) == reference_tokens(small_spec_model, "a", PROMPTS["a"])
    assert list(second["x"].token_ids) == reference_tokens(small_spec_model, "c", PROMPTS["c"])
    assert checked[0] <= 1  # checked from the new request's first token on
