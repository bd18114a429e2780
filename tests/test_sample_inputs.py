"""A sampling step's per-row inputs in one host -> device copy (engine/sample_inputs.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from baton.engine.ops.kernels import resolve_kernels
from baton.engine.rejection_sampler import RejectionSampler
from baton.engine.sample_inputs import is_filtered, is_tempered, sample_inputs
from baton.engine.sampling_params import SamplingParams

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]

PARAMS = [SamplingParams(), SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=5),
          SamplingParams(temperature=0.9, top_p=0.8), SamplingParams(temperature=1.1, top_k=3, top_p=0.55)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [5, 4], ids=["odd", "even"])  # (three float32 columns: odd rows pad a word)
def test_each_row_gets_its_values_for_the_op_that_draws_it(device: str, rows: int) -> None:
    params = PARAMS[:rows]
    seeds = [2**62 + 7, -5, 0, 123456789012, 1][:rows]
    positions = [40, 41, 7, 1_000_000, 3][:rows]
    got = sample_inputs(params, seeds, positions, torch.device(device))
    assert got.seeds.tolist() == seeds and got.positions.tolist() == positions
    assert got.no_drafts.tolist() == [0] * rows and got.top_k.tolist() == [p.top_k for p in params]
    f32 = lambda v: torch.tensor(v, dtype=torch.float32).tolist()  # noqa: E731 (the values as float32 holds them)
    assert got.temperature.tolist() == f32([p.temperature if is_tempered(p) else 0.0 for p in params])
    assert got.temperature_f.tolist() == f32([p.temperature if is_filtered(p) else 0.0 for p in params])
    assert got.top_p.tolist() == f32([p.top_p for p in params])
    for t in (got.seeds, got.positions, got.no_drafts, got.top_k, got.temperature, got.temperature_f, got.top_p):
        assert t.device.type == device and t.shape == (rows,) and t.is_contiguous()
    assert {t.untyped_storage().data_ptr() for t in (got.seeds, got.top_k, got.top_p)} == {
        got.seeds.untyped_storage().data_ptr()}  # one buffer: one copy


def test_tensors_already_on_the_device_are_used_as_they_are() -> None:
    seeds, positions = torch.tensor([3, 4], dtype=torch.int64), torch.tensor([9, 10], dtype=torch.int64)
    got = sample_inputs(PARAMS[1:3], seeds, positions, torch.device("cpu"))
    assert got.seeds is seeds and got.positions is positions and got.top_k.tolist() == [0, 5]
    with pytest.raises(ValueError, match="positions: expected one per row \\(2\\), got 3"):
        sample_inputs(PARAMS[1:3], [1, 2], [1, 2, 3], torch.device("cpu"))


@pytest.mark.parametrize("device", DEVICES)
def test_decide_from_one_copy_equals_verify_without_drafts(device: str) -> None:
    """`decide` on `sample_inputs` (a runner's path) decides each row as `verify` does a row without drafts, for a
    batch of every kind of row and for one of rows with top-k / top-p only (no argmax, no tempered launch)."""
    R, V = 20, 300
    g = torch.Generator().manual_seed(9)
    logits = (torch.randn(R, V, generator=g) * 3).to(torch.bfloat16).to(device)
    rs = RejectionSampler(max_draft=0, kernels=resolve_kernels("auto", device))
    for params in ([dataclasses.replace(PARAMS[i % 5], seed=i) for i in range(R)],
                   [dataclasses.replace(PARAMS[2 + i % 3], seed=i) for i in range(R)]):
        seeds, positions = list(range(100, 100 + R)), [50 + i for i in range(R)]
        ints = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
        want = rs.verify(logits[:, None], ints([[]] * R).view(R, 0), None, ints([0] * R), params, ints(seeds),
                         ints(positions)).output_token_ids[:, 0]
        got = rs.decide(logits, params, sample_inputs(params, seeds, positions, torch.device(device)))
        assert got.tolist() == want.tolist()
        drawn = [i for i, p in enumerate(params) if not p.greedy]
        assert (got[drawn] != logits[drawn].float().argmax(-1)).any()

