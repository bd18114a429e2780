"""benchmarks/spec_bench.py in its smoke mode (tiny presets with one MTP layer, CPU; NemotronH's and Qwen3.5's):
every (K, batch) is timed, a draft pass's bytes equal a count of the engine's real MTP and lm_head tensors, the
table's break-even and speedup follow from the step times, and bad flags fail with a ValueError."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from baton.engine.config import ModelConfig
from baton.engine.make_model import build_config
from baton.engine.weights import expected_weight_shapes

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "spec_bench.py"
_spec = importlib.util.spec_from_file_location("spec_bench", _PATH)
sb = importlib.util.module_from_spec(_spec)
sys.modules["spec_bench"] = sb  # dataclasses look their module up
_spec.loader.exec_module(sb)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("spec_bench")
    assert sb.main(["--smoke", "--ks", "0,1,2", "--acceptance", "1.5,1.75", "--out", str(out), "--no-progress"]) == 0
    return json.loads((out / sb.JSON_NAME).read_text())


def test_every_k_and_batch_is_timed(smoke):
    bc = smoke["meta"]["bench_config"]
    got = [(r["k"], r["batch"]) for r in smoke["results"]]
    assert got == [(k, b) for k in bc["ks"] for b in bc["batches"]]
    for r in smoke["results"]:
        assert r["step_ms"] > 0 and r["floor_ms"] > 0
        if r["k"] == 0:
            assert r["tokens_per_step"] == r["batch"]
        else:  # a verify row emits its last token and the drafts accepted before the first rejection
            assert r["batch"] <= r["tokens_per_step"] <= r["batch"] * (1 + r["k"])
    assert smoke["acceptance"] == [1.5, 1.75]


@pytest.fixture(scope="module")
def qwen_smoke(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("spec_bench_qwen")
    assert sb.main(["--smoke", "--preset", "qwen3.5-tiny", "--ks", "0,1,2", "--acceptance", "1.5,1.75",
                    "--out", str(out), "--no-progress"]) == 0
    return json.loads((out / sb.JSON_NAME).read_text())


SMOKES = [("tiny", "smoke"), ("qwen3.5-tiny", "qwen_smoke")]


@pytest.mark.parametrize("preset", ["tiny", "qwen3.5-tiny"])
def test_draft_pass_bytes_equal_the_engines_real_tensors(preset):
    """The drafter's parameters (Qwen3.5: fc, pre-fc norms, its layer, norm), the lm_head and the MTP attention's
    own KV pool layer, counted from the engine a verify step runs."""
    bc = sb.SpecBenchConfig(device="cpu", preset=preset, ks=(0, 1), batches=(2,), context=24, steps=3,
                            progress=False)
    cfg, hf = sb.model_config(preset)
    weights = sb.random_weights(cfg, hf, torch.device("cpu"), torch.float32, 0, False)
    engine = sb.build_engine(cfg, weights, bc, 1)
    # Its state dict: the checkpoint's tensors (Qwen3.5's rotary frequencies are a buffer computed, not read).
    mtp = sum(t.numel() * t.element_size() for t in engine.runner.mtp.state_dict().values())
    head = engine.model.output_weight()
    assert sb.draft_pass_bytes(cfg, engine.dtype, 2, 0) == mtp + head.numel() * head.element_size()
    # The MTP attention layers' KV of the batch's context: its own pool layers, one token each.
    kv = engine.pools.kv[0, engine.pools.num_target_kv_layers:]
    per_token = kv.numel() * kv.element_size() // engine.config.block_size
    assert per_token > 0
    assert sb.draft_pass_bytes(cfg, engine.dtype, 2, 100) - sb.draft_pass_bytes(cfg, engine.dtype, 2, 0) \
        == pytest.approx(100 * per_token)


@pytest.mark.parametrize("preset", ["tiny", "qwen3.5-tiny"])
def test_draft_pass_reads_one_step_of_several_mtp_layers(preset):
    """Draft step k runs only the layers of step k % n in both families: more MTP layers, the same bytes a pass."""
    one, two = (ModelConfig.from_hf_dict(build_config(preset, mtp_layers=n)) for n in (1, 2))
    total = sum(math.prod(s) for n, s in expected_weight_shapes(two).items() if n.startswith("mtp.")) * 4
    assert sb.mtp_step_weight_bytes(two, torch.float32) == sb.mtp_step_weight_bytes(one, torch.float32) < total


@pytest.mark.parametrize("preset,fixture", SMOKES)
def test_floor_adds_k_draft_passes(preset, fixture, request):
    """In the run: the decode traffic (the family's recurrent states) plus K draft passes at the steps' context,
    over the copy rate."""
    run = request.getfixturevalue(fixture)
    assert run["meta"]["bench_config"]["preset"] == preset
    cfg, _ = sb.model_config(preset)
    copy = run["copy_gbps"] * 1e9
    for r in run["results"]:
        ctx = r["context_tokens"]
        assert ctx >= r["batch"] * run["meta"]["bench_config"]["context"]
        want = sb.decode_traffic(cfg, torch.float32, torch.float32, r["batch"], ctx).total
        want += r["k"] * sb.draft_pass_bytes(cfg, torch.float32, r["batch"], ctx)
        assert r["floor_ms"] == pytest.approx(want / copy * 1e3, rel=1e-9)


def test_qwen3_5_smoke_times_every_k_with_a_break_even(qwen_smoke):
    """Qwen3.5 through the same benchmark: its MTP drafter's `mtp.*` weights loaded (the parameter count), every
    (K, batch) timed, a floor growing with K, and a positive break-even acceptance per row in the JSON."""
    bc = qwen_smoke["meta"]["bench_config"]
    cfg, _ = sb.model_config("qwen3.5-tiny")
    shapes = expected_weight_shapes(cfg, include_mtp=True)
    assert "mtp.fc.weight" in shapes and qwen_smoke["meta"]["params"] == sum(math.prod(s) for s in shapes.values())
    got = [(r["k"], r["batch"]) for r in qwen_smoke["results"]]
    assert got == [(k, b) for k in bc["ks"] for b in bc["batches"]]
    floors = {(r["k"], r["batch"]): r["floor_ms"] for r in qwen_smoke["results"]}
    for r, even in zip(qwen_smoke["results"], qwen_smoke["break_even"], strict=True):
        assert r["step_ms"] > 0 and (even["k"], even["batch"]) == (r["k"], r["batch"])
        assert even["acceptance"] == pytest.approx(r["step_ms"] / next(
            x["step_ms"] for x in qwen_smoke["results"] if x["k"] == 0 and x["batch"] == r["batch"]))
        assert even["acceptance"] > 0 and (r["k"] or even["acceptance"] == 1.0)
        assert r["batch"] <= r["tokens_per_step"] <= r["batch"] * (1 + r["k"])
        if r["k"]:
            assert floors[r["k"], r["batch"]] > floors[r["k"] - 1, r["batch"]]


def test_table_break_even_and_speedup(smoke):
    bc = sb.SpecBenchConfig(**{**smoke["meta"]["bench_config"], "ks": tuple(smoke["meta"]["bench_config"]["ks"]),
                               "batches": tuple(smoke["meta"]["bench_config"]["batches"]),
                               "acceptance": tuple(smoke["acceptance"])})
    results = [sb.SpecResult(**r) for r in smoke["results"]]
    text = sb.table(sb.Report(meta=smoke["meta"], copy_gbps=smoke["copy_gbps"], results=results), bc)
    base = {r.batch: r.step_ms for r in results if r.k == 0}
    for r in results:
        tau = 1.0 if r.k == 0 else bc.acceptance[r.k - 1]
        row = next(line for line in text.splitlines() if line.startswith(f"| {r.k} | {r.batch} |"))
        assert f"| {r.step_ms / base[r.batch]:.2f} |" in row  # break-even acceptance
        assert f"| {tau * base[r.batch] / r.step_ms:.2f}× |" in row  # speedup at the checkpoint's acceptance


def test_acceptance_from_mtp_bench_json(tmp_path):
    path = tmp_path / "mtp.json"
    path.write_text(json.dumps({"mtp": [{"k": 0, "mean_acceptance_length": 0.0},
                                        {"k": 1, "mean_acceptance_length": 1.47},
                                        {"k": 2, "mean_acceptance_length": 1.63}]}))
    assert sb.acceptance_from_json(path) == (1.47, 1.63)
    path.write_text(json.dumps({"mtp": [{"k": 1, "mean_acceptance_length": 1.4},
                                        {"k": 3, "mean_acceptance_length": 1.6}]}))
    with pytest.raises(ValueError, match="expected mtp rows for K = 1..n"):
        sb.acceptance_from_json(path)


@pytest.mark.parametrize("argv,match", [
    (["--ks", "1,2"], "including 0"),
    (["--ks", "0,9"], r"integers in 0\.\.8"),
    (["--ks", "0,3", "--acceptance", "1.5,1.6"], "a value for every K up to 3"),
    (["--acceptance", "0.5,1.6,1.7,1.8"], "mean tokens per verify row"),
    (["--batches", "0"], "positive integers"),
    (["--acceptance", "x"], "comma-separated numbers"),
    (["--temperature", "-1"], r"--temperature: expected 0 \(greedy\) to 100, got -1"),
    (["--top-p", "0.9"], r"--top-p: expected a value in \(0, 1\], below 1 only with a --temperature, got 0.9"),
    (["--temperature", "1", "--top-p", "0"], r"--top-p: .* got 0.0 at temperature 1"),
])
def test_bad_flags(argv, match):
    with pytest.raises(ValueError, match=match):
        sb.parse_args(["--smoke", *argv])


@pytest.mark.parametrize("top_p, label", [(1.0, "temperature 0.8"), (0.9, "temperature 0.8, top-p 0.9")])
def test_temperature_times_seeded_sampling_rows(top_p, label):
    """--temperature (and --top-p): every request samples with them and a seed of its own, and the steps are timed
    as greedy ones."""
    bc = sb.SpecBenchConfig(device="cpu", preset="tiny", ks=(0, 1), batches=(2,), context=24, steps=3,
                            temperature=0.8, top_p=top_p, progress=False)
    assert sb.sampling_label(bc) == label
    cfg, hf = sb.model_config("tiny")
    weights = sb.random_weights(cfg, hf, torch.device("cpu"), torch.float32, 0, False)
    engine = sb.build_engine(cfg, weights, bc, 1)
    added = []
    add = engine.runner.add_request
    engine.runner.add_request = lambda rid, params, history: added.append(params) or add(rid, params, history)
    r = sb.bench_batch(engine, bc, 2, copy=10.0)
    assert r.step_ms > 0 and 2 <= r.tokens_per_step <= 4
    decode = added[2:]  # (the first two: the prefill-only requests)
    assert {(p.temperature, p.top_p) for p in added} == {(0.8, top_p)} and len({p.seed for p in decode}) == 2
    assert r.graphed == 0.0  # (the CPU runs no graphs)
