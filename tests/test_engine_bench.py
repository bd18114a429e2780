"""benchmarks/engine_bench.py in its smoke mode (tiny preset, CPU): the JSON's roofline bytes equal a count
of the engine's real parameter and pool tensors, its ratios and MFU follow from its own numbers, and bad
flags fail with a ValueError. Also sampling_cost_bench.py, which times engine_bench's decode steps with penalties,
min-p and logprobs against plain sampling: its rows, and that its extras rows really carried them."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import statistics
import sys
from pathlib import Path

import pytest
import torch

from baton.engine.config import ModelConfig
from baton.engine.make_model import build_config

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "engine_bench.py"
_spec = importlib.util.spec_from_file_location("engine_bench", _PATH)
eb = importlib.util.module_from_spec(_spec)
sys.modules["engine_bench"] = eb  # dataclasses look their module up
_spec.loader.exec_module(eb)
_SC_PATH = _PATH.with_name("sampling_cost_bench.py")
_sc_spec = importlib.util.spec_from_file_location("sampling_cost_bench", _SC_PATH)
sc = importlib.util.module_from_spec(_sc_spec)
sys.modules["sampling_cost_bench"] = sc
_sc_spec.loader.exec_module(sc)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("engine_bench")
    assert eb.main(["--smoke", "--out", str(out), "--no-progress"]) == 0
    return json.loads((out / eb.JSON_NAME).read_text())


@pytest.fixture(scope="module")
def engine(smoke):
    """The engine the smoke run measured, rebuilt from the recorded configuration."""
    cfg = dict(smoke["meta"]["bench_config"])
    cfg["batches"], cfg["prefill_splits"] = tuple(cfg["batches"]), tuple(cfg["prefill_splits"])
    return eb.build_engine(eb.BenchConfig(**{**cfg, "progress": False}))


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def test_decode_bytes_match_the_real_tensors(smoke, engine):
    model, pools = engine.model, engine.pools
    emb = model.model.embeddings.weight
    assert model.lm_head is not None  # the tiny preset has an untied head: only B embedding rows are read
    weights = sum(tensor_bytes(p) for p in model.parameters()) - tensor_bytes(emb)
    n_slots = pools.states["ssm"].shape[0]
    ssm_slot, conv_slot = tensor_bytes(pools.states["ssm"]) // n_slots, tensor_bytes(pools.states["conv"]) // n_slots
    kv_layers = pools.kv_layers()  # [blocks, 2, block_size, Hkv, D] each
    kv_token = sum(tensor_bytes(kv) // (kv.shape[0] * kv.shape[2]) for kv in kv_layers)
    assert smoke["decode"], "no decode results"
    for d in smoke["decode"]:
        b, t = d["batch"], d["traffic"]
        ctx_tokens = b * d["mean_context_tokens"]
        expected = {"weights": weights, "embedding_rows": b * tensor_bytes(emb[0]), "ssm_state": 2 * b * ssm_slot,
                    "conv_state": 2 * b * conv_slot, "kv_read": ctx_tokens * kv_token, "kv_write": b * kv_token}
        for key, value in expected.items():
            assert t[key] == pytest.approx(value, rel=1e-12), key
        assert t["total"] == pytest.approx(sum(expected.values()), rel=1e-12)
        assert d["traffic_from_tensors"] == t


def test_decode_ratios_follow_from_the_measurements(smoke):
    bc = smoke["meta"]["bench_config"]
    assert [d["batch"] for d in smoke["decode"]] == list(bc["batches"])
    for d in smoke["decode"]:
        # Decode step j (warm-up included) reads the prompt plus about j tokens; the timed steps (pipelined, then
        # one at a time) follow the warm-up.
        lo, hi = bc["context"] + bc["steps"], bc["context"] + 3 * bc["steps"] + 3
        assert lo <= d["mean_context_tokens"] <= hi
        roof = d["traffic"]["total"] / (smoke["copy_gbps"] * 1e9) * 1e3
        assert d["roofline_ms"] == pytest.approx(roof)
        # On the CPU nothing is queued: the steady state is the run's wall time / steps.
        assert d["async_scheduling"] and d["step_ms_steady"] is None and d["step_ms"] == d["step_ms_mean"]
        assert d["ratio"] == pytest.approx(d["step_ms"] / roof)
        assert d["forward_ratio"] == pytest.approx(d["forward_ms"] / roof)
        assert d["tokens_per_s"] == pytest.approx(d["batch"] / (d["step_ms"] / 1e3))
        assert 0 < d["step_ms_min"] <= d["step_ms_median"] and d["forward_ms"] > 0 and d["step_ms_one_at_a_time"] > 0



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_steady_step_time_is_a_device_span_inside_the_wall_time(tmp_path):
    """On CUDA the step time is the device's span from the end of the first timed step to the end of the last:
    positive, and (steps - 1) of it fit inside the run's wall time."""
    out = tmp_path / "e.json"
    assert eb.main(["--device", "cuda", "--preset", "tiny", "--batches", "1,4", "--context", "24", "--steps", "6",
                    "--prefill-tokens", "64", "--prefill-splits", "1", "--reps", "1", "--mixed-batch", "0",
                    "--no-prefill-continued", "--copy-mib", "8", "--matmul-n", "256", "--no-progress",
                    "--out", str(out)]) == 0
    for d in json.loads(out.read_text())["decode"]:
        steady, steps = d["step_ms_steady"], d["steps"]
        assert d["async_scheduling"] and steady is not None and steady > 0 and d["step_ms"] == steady
        assert steady * (steps - 1) <= d["step_ms_mean"] * steps * 1.001 + 0.05

def test_prefill_flops_and_mfu(smoke, engine):
    cfg = engine.model_config
    # Linear weights a token multiplies, counted from the modules (the tiny preset has no MoE layer); the tail
    # (the last cache-writing layer's output projection and the layers after it) runs on the sampled tokens only.
    layers = engine.model.model.layers
    last = engine.model.model.last_cache_layer
    tail_modules = [layers[last].mixer.out_proj if hasattr(layers[last].mixer, "out_proj") else layers[last].mixer.o_proj,
                    *layers[last + 1:].modules()]
    tail_params = sum(m.weight.numel() for m in tail_modules if isinstance(m, torch.nn.Linear))
    linear_params = sum(m.weight.numel() for m in layers.modules() if isinstance(m, torch.nn.Linear))
    assert 0 < tail_params < linear_params
    bc = smoke["meta"]["bench_config"]
    assert [p["prompts"] for p in smoke["prefill"]] == list(bc["prefill_splits"])
    for p in smoke["prefill"]:
        n, T = p["prompts"], p["tokens"]
        L = T // n
        f = p["flops"]
        assert f["linear"] == 2 * (T * (linear_params - tail_params) + n * tail_params)
        assert f["lm_head"] == 2 * n * tensor_bytes(engine.model.lm_head.weight) // engine.dtype.itemsize
        assert f["attention"] == len(cfg.attention_layer_ids) * n * 2 * cfg.num_attention_heads * cfg.head_dim \
            * L * (L + 1)
        H, P, N, Q, G = (cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size, cfg.chunk_size, cfg.n_groups)
        assert f["ssd"] == len(cfg.mamba_layer_ids) * T * (4 * H * P * N + (Q + 1) * (G * N + H * P))
        assert f["total"] == f["linear"] + f["lm_head"] + f["attention"] + f["ssd"]
        tflops = f["total"] / (p["step_ms_median"] / 1e3) / 1e12
        assert p["tflops"] == pytest.approx(tflops)
        assert p["mfu"] == pytest.approx(tflops / p["matmul_tflops"])
        assert p["matmul_tflops"] == smoke["matmul_tflops"] > 0
        assert p["tokens_per_s"] == pytest.approx(T / (p["step_ms_median"] / 1e3))
        assert p["mfu"] > 0 and p["forward_mfu"] > 0  # no bound above: CPU timings on a shared machine are noisy


def test_continued_prefill_step(smoke):
    """The serving-like step ran (its RuntimeErrors check the rows of both steps: B0 whole and A's head, then A's
    tail and B1): tokens/2 continuing after the first half, beside tokens/2 fresh; tok/s from its own step time."""
    c, bc = smoke["prefill_continued"], smoke["meta"]["bench_config"]
    T = bc["prefill_tokens"]
    assert bc["prefill_continued"] is True
    assert (c["head"], c["tail"], c["reps"]) == (T - T // 2, T // 2, bc["reps"])
    assert c["tokens"] == 2 * (T // 2) and 0 < c["step_ms_min"] <= c["step_ms_median"]
    assert c["tokens_per_s"] == pytest.approx(c["tokens"] / (c["step_ms_median"] / 1e3))


def test_mixed_steps(smoke):
    """The mixed-step rows ran (their RuntimeErrors check each timed step's rows: B decode rows alone, then B decode
    rows and one prompt chunk): one decode row (no graphs on the CPU, so no eager copy of it), then one per prompt
    size, each with its own step and host times."""
    mx, bc = smoke["mixed"], smoke["meta"]["bench_config"]
    assert mx["batch"] == bc["mixed_batch"] > 0 and mx["context"] == bc["context"]
    assert [(r["prompt_tokens"], r["graphed"]) for r in mx["rows"]] == [(0, False)] + [
        (p, False) for p in bc["mixed_prompt_tokens"]]
    for r in mx["rows"]:
        assert r["decode_rows"] == mx["batch"] and r["steps"] >= 1 and r["step_ms"] > 0 and r["host_ms"] > 0
    assert mx["rows"][0]["steps"] == bc["steps"] and mx["rows"][1]["steps"] == eb.MIXED_CHUNKS - 2


def test_mixed_steps_can_be_skipped(tmp_path):
    argv = ["--smoke", "--batches", "1", "--prefill-splits", "1", "--no-prefill-continued", "--no-progress"]
    tiny = ModelConfig.from_hf_dict(build_config("tiny"))
    for mixed, seqs in ((None, eb.DEFAULTS["smoke"]["mixed_batch"] + 1), ("0", 2)):
        _, bc = eb.parse_args(argv + (["--mixed-batch", mixed] if mixed else []))
        assert eb.engine_setup(tiny, bc, torch.float32, torch.float32).max_num_seqs == seqs  # B rows + the prompt
    assert eb.main(argv + ["--mixed-batch", "0", "--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / eb.JSON_NAME).read_text())["mixed"] is None


def test_8b_like_traffic_is_the_known_size():
    cfg = ModelConfig.from_hf_dict(build_config("8b-like"))
    t = eb.decode_traffic(cfg, torch.bfloat16, torch.float32, batch=256, context_tokens=256 * 1024)
    # 8.10 B parameters, the 131072 x 4096 embedding table left out, in bf16.
    assert t.weights == (8_100_852_736 - 131072 * 4096) * 2
    # 24 Mamba layers of 128 heads x 64 x 128 fp32 state, read and written.
    assert t.ssm_state == 2 * 256 * 24 * 128 * 64 * 128 * 4
    assert t.kv_read == 256 * 1024 * 4 * 2 * 8 * 128 * 2
    flops = eb.prefill_flops(cfg, [8192])
    # The tail: the last Mamba layer's out_proj (8192 x 4096) and the MLP after it (2 x 4096 x 21504), 3 % of all.
    tail = eb.matmul_params_per_token(cfg, tail=True)
    assert tail == 8192 * 4096 + 2 * 4096 * 21504
    assert tail + eb.matmul_params_per_token(cfg, tail=False) == eb.matmul_params_per_token(cfg)
    assert math.isclose(tail / eb.matmul_params_per_token(cfg), 0.030, abs_tol=0.001)
    assert flops.linear == 2 * (8192 * (eb.matmul_params_per_token(cfg) - tail) + tail)
    assert math.isclose(flops.total / (2 * 8192 * 8.1e9), 1.0, rel_tol=0.15)


@pytest.mark.parametrize("argv", [
    ["--smoke", "--batches", "0"],
    ["--smoke", "--batches", "1,x"],
    ["--smoke", "--prefill-splits", "3"],   # 64 tokens do not split in 3
    ["--smoke", "--context", "1"],
    ["--smoke", "--steps", "0"],
    ["--smoke", "--preset", "huge"],
    ["--smoke", "--device", "cuda"],
    ["--smoke", "--mixed-batch", "-1"],
    ["--smoke", "--mixed-prompt-tokens", "8,0"],
    ["--smoke", "--compare-fp8", "int4"],
    ["--smoke", "--compare-fp8", "fp8+fp8-block"],
    ["--smoke", "--compare-fp8", "fp8-block,fp8-block"],
    ["--smoke", "--compare-fp8", "fp8,"],
])
def test_bad_flags(argv):
    with pytest.raises(ValueError, match="expected"):
        eb.main(argv)


def test_plot(smoke, tmp_path):
    pytest.importorskip("matplotlib")
    src = tmp_path / "r.json"
    src.write_text(json.dumps(smoke))
    assert eb.main(["--plot", str(src), "--png", str(tmp_path / "r.png")]) == 0
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_info_commit_can_be_named_by_the_environment(monkeypatch):
    from benchmarks.run_info import git_commit

    monkeypatch.delenv("BATON_COMMIT", raising=False)
    assert git_commit()  # this checkout's HEAD (or "unknown" without git)
    monkeypatch.setenv("BATON_COMMIT", "f5cb2b7")
    assert git_commit() == "f5cb2b7"


def test_qwen3_5_smoke_counts_its_gated_deltanet_state_and_flops(tmp_path):
    """The Qwen3.5 family through the same benchmark: its decode bytes (the Gated DeltaNet's recurrent and conv state)
    equal the count from the engine's real tensors, and its prefill FLOPs count the GDN layers."""
    assert eb.main(["--smoke", "--preset", "qwen3.5-tiny", "--mixed-batch", "0", "--no-prefill-continued",
                    "--out", str(tmp_path), "--no-progress"]) == 0
    r = json.loads((tmp_path / eb.JSON_NAME).read_text())
    assert r["decode"] and r["prefill"]
    for d in r["decode"]:
        assert d["traffic"] == d["traffic_from_tensors"]
        assert d["traffic"]["ssm_state"] > 0 and d["traffic"]["conv_state"] > 0
    cfg = ModelConfig.from_hf_dict(build_config("qwen3.5-tiny"))
    t = r["prefill"][0]["tokens"]
    hv, dk, dv, q = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.chunk_size
    gdn = 3 * t * hv * (8 * dk * dv + 2 * (q + 1) * (dk + dv))  # the preset's three GDN layers
    assert r["prefill"][0]["flops"]["ssd"] == gdn


@pytest.mark.parametrize("preset", ["tiny", "qwen3.5-tiny"])
def test_weight_bytes_count_what_a_bf16_model_holds(preset):
    """The decode roofline's weight bytes at bf16 equal the loaded model's tensors, the parameters a family holds in
    fp32 whatever the model dtype (Qwen3.5's folded RMSNorm weights) included."""
    from baton.engine.model_family import model_class
    from baton.engine.ops.kernels import resolve_kernels

    hf = build_config(preset)
    cfg = ModelConfig.from_hf_dict(hf)
    weights = eb.random_weights(cfg, hf, torch.device("cpu"), torch.bfloat16, progress=False)
    model = model_class(cfg).from_state_dict(cfg, weights, "cpu", torch.bfloat16, resolve_kernels("auto", "cpu"))
    emb = model.input_embeddings().weight
    held = sum(tensor_bytes(p) for p in model.parameters()) - (0 if cfg.tie_word_embeddings else tensor_bytes(emb))
    assert any(p.dtype == torch.float32 for p in model.parameters()) == (preset == "qwen3.5-tiny")
    assert eb.weight_bytes(cfg, torch.bfloat16) == held


def test_moe_decode_roofline_counts_the_experts_its_tokens_route_to():
    """A MoE model's decode bytes hold of the routed experts the expected share B tokens route to (top-k of E,
    uniform routing): at one token k/E of them, at 256 nearly all; shared experts and dense models count whole."""
    cfg = ModelConfig.from_hf_dict(build_config("nano-30b-a3b-like"))
    bf16, fp32 = torch.bfloat16, torch.float32
    routed = sum(math.prod(s) * 2 for n, s in eb.expected_weight_shapes(cfg, include_mtp=False).items()
                 if ".experts." in n)
    k, e = cfg.num_experts_per_tok, cfg.n_routed_experts
    one, many = eb.decode_traffic(cfg, bf16, fp32, 1, 1000.0), eb.decode_traffic(cfg, bf16, fp32, 256, 256e3)
    assert one.inactive_experts == pytest.approx(routed * (1 - k / e), rel=1e-12)
    assert one.total == pytest.approx(one.weights - routed * (1 - k / e) + one.embedding_rows + one.ssm_state
                                      + one.conv_state + one.kv_read + one.kv_write, rel=1e-12)
    assert many.inactive_experts < 0.01 * routed
    dense = ModelConfig.from_hf_dict(build_config("8b-like"))
    assert eb.decode_traffic(dense, bf16, fp32, 1, 1000.0).inactive_experts == 0


@pytest.fixture(scope="module")
def sampling_cost(tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("sampling_cost") / "sc.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert sc.main(["--smoke", "--batches", "1,3", "--out", str(out), "--no-progress"]) == 0
    return json.loads(out.read_text()), printed.getvalue()


def test_sampling_cost_rows_used_their_parameters(sampling_cost):
    """Per batch, two phases of each kind with positive times; the extras phases' rows had their logits processed
    and every token's logprobs back, the plain ones neither; the ratio follows from the phases' times."""
    data, printed = sampling_cost
    extras = data["meta"]["sampling"]["extras"]
    assert extras["logprobs"] == sc.TOP_LOGPROBS and extras["min_p"] > 0
    assert extras["presence_penalty"] and extras["frequency_penalty"] and extras["repetition_penalty"] != 1
    plain = data["meta"]["sampling"]["plain"]
    assert plain["logprobs"] is None and plain["min_p"] == 0 and plain["temperature"] == extras["temperature"]
    assert [r["batch"] for r in data["results"]] == [1, 3]
    for r in data["results"]:
        assert [p["kind"] for p in r["phases"]] == list(sc.ORDER)
        for p in r["phases"]:
            assert p["step_ms"] > 0 and p["wall_ms"] > 0 and p["host_ms"] > 0
            assert p["tokens"] == r["batch"] * r["steps"]  # one token a row per warm-up step
            used = p["kind"] == "extras"
            assert p["processed"] is used
            assert p["logprob_tokens"] == (p["tokens"] if used else 0)
            assert p["graph_steps"] == 0  # no CUDA graphs on the CPU
        for kind in sc.KINDS:
            mean = statistics.fmean(p["step_ms"] for p in r["phases"] if p["kind"] == kind)
            assert r[f"{kind}_ms"] == pytest.approx(mean)
        assert r["ratio"] == pytest.approx(r["extras_ms"] / r["plain_ms"])
        assert r["goal_met"] == (r["ratio"] <= sc.GOAL)
        row = next(line for line in printed.splitlines() if line.startswith(f"| {r['batch']} |"))
        assert f"| {r['plain_ms']:.3f} | {r['extras_ms']:.3f} | {r['ratio']:.3f} |" in row
    assert f"| batch | plain ms | extras ms | ratio | goal ≤ {sc.GOAL} |" in printed


def test_sampling_cost_refuses_outputs_without_their_parameters():
    """The check on the warm-up outputs fails an extras token without its logprobs and a plain token with some."""
    from baton.engine.llm_engine import RequestOutput
    from baton.engine.token_logprob import TokenLogprob

    def out(logprobs):
        return RequestOutput("r", (1, 2), (3,), (3,), False, None, logprobs=logprobs)

    full = (TokenLogprob(3, -0.5, tuple((t, -1.0) for t in range(sc.TOP_LOGPROBS))),)
    assert sc.check_outputs("extras", [out(full)]) == (1, 1)
    assert sc.check_outputs("plain", [out(None)]) == (1, 0)
    with pytest.raises(RuntimeError, match="extras row"):
        sc.check_outputs("extras", [out(None)])
    with pytest.raises(RuntimeError, match="extras row"):
        sc.check_outputs("extras", [out((TokenLogprob(3, -0.5, ((3, -0.5),)),))])
    with pytest.raises(RuntimeError, match="plain row"):
        sc.check_outputs("plain", [out(full)])


@pytest.mark.parametrize("argv", [
    ["--smoke", "--steps", "1"],
    ["--smoke", "--batches", "0"],
    ["--smoke", "--context", "1"],
    ["--smoke", "--device", "cuda"],
    ["--smoke", "--preset", "huge"],
])
def test_sampling_cost_bad_flags(argv):
    with pytest.raises(ValueError, match="expected"):
        sc.main(argv)


def test_compare_fp8_times_each_variant_against_the_model_dtype(tmp_path, capsys):
    """--compare-fp8 on the tiny preset: the model dtype's rows, then each variant's, every step timed; the FP8
    variants' models hold every Linear make-model --quantize stores in FP8 as an FP8Linear with float8_e4m3fn
    weights (counted from the shapes here, so that a run that skipped the quantization fails), the kv-fp8 one an
    FP8 KV pool; the table prints each step's ratio."""
    from baton.engine.fp8_checkpoint import quantizable

    assert eb.main(["--smoke", "--batches", "1,2", "--steps", "2", "--reps", "1", "--context", "8", "--no-progress",
                    "--compare-fp8", "fp8-block,fp8+kv-fp8", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / eb.JSON_NAME).read_text())
    assert r["meta"]["bench_config"]["prefill_splits"] == [1] and r["meta"]["bench_config"]["mixed_batch"] == 0
    shapes = eb.expected_weight_shapes(ModelConfig.from_hf_dict(build_config("tiny")), include_mtp=False)
    fp8 = {n: math.prod(s) for n, s in shapes.items() if quantizable(n, s)}
    assert fp8 and not any(".experts." in n for n in fp8)  # the tiny preset: every one stays FP8 at load
    variants = {v["name"]: v for v in r["variants"]}
    assert list(variants) == ["base", "fp8-block", "fp8+kv-fp8"]
    for name, v in variants.items():
        assert v["error"] is None, name
        assert [d["batch"] for d in v["decode"]] == [1, 2] and all(d["step_ms"] > 0 for d in v["decode"])
        assert [p["prompts"] for p in v["prefill"]] == [1] and v["prefill"][0]["step_ms_median"] > 0
        assert v["left_bytes"] == 0  # on the CPU nothing is counted; on CUDA the run checks it
        quantized = name != "base"
        assert v["fp8_linears"] == (len(fp8) if quantized else 0)
        assert v["fp8_weight_bytes"] == (sum(fp8.values()) if quantized else 0)  # one byte a weight
        assert v["kv_dtype"] == ("float8_e4m3fn" if name.endswith("kv-fp8") else "float32")
    # The roofline counts the bytes the variant's tensors hold: FP8 weights, and an FP8 KV pool (the tiny preset's
    # model dtype is fp32: a quarter of the bytes a token).
    base = variants["base"]["decode"][0]["traffic"]
    for name in ("fp8-block", "fp8+kv-fp8"):
        t = variants[name]["decode"][0]["traffic"]
        assert t["weights"] < base["weights"] and variants[name]["weight_bytes"] < variants["base"]["weight_bytes"]
        assert t["kv_write"] * (4 if name.endswith("kv-fp8") else 1) == base["kv_write"]
    table = capsys.readouterr().out.split("## Engine: FP8")[1]
    base_ms = variants["base"]["decode"][0]["step_ms"]
    ratio = variants["fp8-block"]["decode"][0]["step_ms"] / base_ms
    assert f"| decode, batch 1 | {base_ms:.3f} | {variants['fp8-block']['decode'][0]['step_ms']:.3f} | {ratio:.3f} |" \
        in table
    assert "| prefill 1 × 64 |" in table


def test_compare_fp8_stops_where_a_timed_engine_stays_referenced(monkeypatch):
    """Two models may not fit side by side: a variant whose engine something still references once timed stops the
    run before the next one is built."""
    kept = []
    monkeypatch.setattr(eb, "_time_variant", lambda engine, bc, copy, mm: (kept.append(engine), ([], []))[1])
    bc = eb.BenchConfig(device="cpu", preset="tiny", batches=(1,), context=8, steps=1, prefill_tokens=16,
                        prefill_splits=(1,), prefill_continued=False, mixed_batch=0, progress=False)
    with pytest.raises(RuntimeError, match="expected its model freed once timed"):
        eb.bench_variant(bc, eb.Fp8Variant("fp8-block"), 1.0, 1.0, 0)
    assert kept
