"""benchmarks/serving_bench.py: the Poisson schedule, the percentile / goodput math, GPU pinning of node
processes, and the `--smoke` run end to end on the CPU (real router and node processes, tiny model)."""

from __future__ import annotations

import importlib.util
import json
import math
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

_ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("serving_bench", _ROOT / "benchmarks" / "serving_bench.py")
sb = importlib.util.module_from_spec(_spec)
sys.modules["serving_bench"] = sb  # dataclasses look their module up
_spec.loader.exec_module(sb)

LOAD = sb.LoadSpec(prompt_min=4, prompt_max=9, output_min=2, output_max=5, duration_s=10.0, seed=3)
SLO = sb.Slo(ttft_s=1.0, tpot_s=0.1)


# ---- schedule -------------------------------------------------------------------------------------------

def test_poisson_arrivals_seeded_and_at_the_rate():
    a = sb.poisson_arrivals(10.0, 2000.0, random.Random(7))
    assert a == sb.poisson_arrivals(10.0, 2000.0, random.Random(7))
    assert a != sb.poisson_arrivals(10.0, 2000.0, random.Random(8))
    assert all(0 <= x < 2000.0 for x in a) and a == sorted(a)
    # 20,000 expected arrivals: Poisson sd ~141, so 3 % is > 4 sd.
    assert len(a) / 2000.0 == pytest.approx(10.0, rel=0.03)
    gaps = np.diff(a)
    assert gaps.mean() == pytest.approx(0.1, rel=0.03)
    # Exponential gaps: sd == mean.
    assert gaps.std() == pytest.approx(0.1, rel=0.05)


def test_poisson_arrivals_refuses_bad_rates():
    for rate in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="rate: expected"):
            sb.poisson_arrivals(rate, 1.0, random.Random(0))


def test_make_requests_is_deterministic_and_within_the_stated_distribution():
    reqs = sb.make_requests(LOAD, 5.0, vocab_size=50, salt=1)
    assert reqs == sb.make_requests(LOAD, 5.0, vocab_size=50, salt=1)
    assert reqs != sb.make_requests(LOAD, 5.0, vocab_size=50, salt=2)
    assert 20 <= len(reqs) <= 80  # 50 expected
    assert [r.index for r in reqs] == list(range(len(reqs)))
    for r in reqs:
        assert LOAD.prompt_min <= len(r.prompt) <= LOAD.prompt_max
        assert LOAD.output_min <= r.max_tokens <= LOAD.output_max
        assert all(sb.FIRST_ID <= t < 50 for t in r.prompt)
    burst = sb.burst(LOAD, 6, vocab_size=50, salt=0)
    assert len(burst) == 6 and all(r.arrival_s == 0.0 for r in burst)


def test_load_spec_and_slo_validation():
    with pytest.raises(ValueError, match="prompt_max: expected >= prompt_min"):
        sb.LoadSpec(prompt_min=10, prompt_max=5, output_min=2, output_max=3, duration_s=1.0, seed=0)
    with pytest.raises(ValueError, match="output_min: expected an integer >= 2"):
        sb.LoadSpec(prompt_min=2, prompt_max=5, output_min=1, output_max=3, duration_s=1.0, seed=0)
    with pytest.raises(ValueError, match="duration_s"):
        sb.LoadSpec(prompt_min=2, prompt_max=5, output_min=2, output_max=3, duration_s=0.0, seed=0)
    with pytest.raises(ValueError, match="slo tpot_s"):
        sb.Slo(ttft_s=1.0, tpot_s=-1.0)


def test_bad_flags_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="configs: expected distinct names out of agg, disagg, got agg,nope"):
        sb.parse_args(["--smoke", "--out", str(tmp_path), "--configs", "agg,nope"])
    with pytest.raises(ValueError, match="--rates: expected comma-separated numbers"):
        sb.parse_args(["--smoke", "--out", str(tmp_path), "--rates", "1,fast"])
    with pytest.raises(ValueError, match="rates / rate_fractions: expected finite numbers > 0"):
        sb.parse_args(["--smoke", "--out", str(tmp_path), "--rates", "1,0"])
    with pytest.raises(ValueError, match="warmup_s: expected a finite number >= 0, got -1.0"):
        sb.parse_args(["--smoke", "--out", str(tmp_path), "--warmup-s", "-1"])
    cfg = sb.parse_args(["--out", str(tmp_path)])
    assert cfg.rates == () and cfg.gpus == 2 and cfg.model_preset == "1b-hybrid"  # GPU defaults: auto rates
    sb.check_engine_args(cfg.engine_args)  # the GPU defaults parse (EngineConfig does not open the device)
    with pytest.raises(ValueError, match="engine field 'max_num_batched_tokens'"):
        sb.check_engine_args(["--max-num-seqs", "64", "--max-num-batched-tokens", "32"])
    with pytest.raises(ValueError, match="expected engine flags only, got unknown '--bogus 1'"):
        sb.check_engine_args(["--bogus", "1"])


# ---- statistics -----------------------------------------------------------------------------------------

def test_percentile_matches_numpy_and_is_ordered():
    rng = random.Random(0)
    for n in (1, 2, 3, 10, 101):
        v = sorted(rng.expovariate(1.0) for _ in range(n))
        for q in (0, 1, 50, 90, 99, 100):
            assert sb.percentile(v, q) == pytest.approx(float(np.percentile(v, q)))
        s = sb.summarize(v)
        assert s.p50 <= s.p90 <= s.p99
        assert s.mean == pytest.approx(sum(v) / n)
    assert sb.summarize([]) is None
    with pytest.raises(ValueError, match="at least one value"):
        sb.percentile([], 50)


def _result(i, arrival, ttft, gaps, finished=True):
    n = len(gaps) + 1
    end = arrival + ttft + sum(gaps)
    return sb.RequestResult(i, arrival, 10, end if finished else None, ttft, tuple(gaps), n,
                            None if finished else "cancelled")


def test_rate_point_goodput_counts_only_requests_meeting_both_bounds():
    results = [
        _result(0, 0.0, 0.5, [0.05] * 4),          # good
        _result(1, 1.0, 1.5, [0.05] * 4),          # TTFT too long
        _result(2, 2.0, 0.2, [0.05, 0.3, 0.05]),   # mean ITL 0.133 > 0.1
        _result(3, 3.0, 0.2, [0.09] * 9),          # good (mean 0.09)
        _result(4, 4.0, 0.2, [0.05], finished=False),  # cancelled: not completed, not good
    ]
    assert results[2].tpot_s == pytest.approx(0.4 / 3)
    p = sb.rate_point("agg", 0.5, 5.0, results, SLO)
    assert (p.requests, p.completed, p.failed) == (5, 4, 1)
    # Window: from 0 to max(arrival window end 5.0, last completion 3.0 + 0.2 + 0.81 = 4.01) = 5.0.
    assert p.window_s == pytest.approx(5.0)
    assert p.throughput_rps == pytest.approx(4 / 5.0)
    assert p.goodput_rps == pytest.approx(2 / 5.0)
    assert p.slo_attainment == pytest.approx(2 / 5)
    assert p.goodput_rps <= p.throughput_rps
    assert p.ttft_s.p50 == pytest.approx(0.35)  # of the 4 completed: 0.2, 0.2, 0.5, 1.5
    assert p.itl_s.p99 == pytest.approx(float(np.percentile([0.05] * 8 + [0.05, 0.3, 0.05] + [0.09] * 9, 99)))
    # A completion after the window's end stretches it.
    late = sb.rate_point("agg", 0.5, 0.5, results[:1], SLO)
    assert late.window_s == pytest.approx(0.7)
    assert late.goodput_rps == late.throughput_rps == pytest.approx(1 / 0.7)


def test_goodput_at_another_slo_from_the_per_request_records(tmp_path, capsys):
    results = [
        _result(0, 0.0, 0.5, [0.05] * 4),          # good under both
        _result(1, 1.0, 1.5, [0.05] * 4),          # TTFT 1.5 s
        _result(2, 2.0, 0.2, [0.05, 0.3, 0.05]),   # TPOT 0.133 s
        _result(4, 4.0, 0.2, [0.05], finished=False),  # never good
    ]
    p = sb.rate_point("agg", 0.5, 5.0, results, SLO)
    assert p.per_request[3] == (None, None) and len(p.per_request) == 4
    assert sb.with_slo(p, SLO) == p  # the SLO it ran with: the same numbers
    loose = sb.with_slo(p, sb.Slo(ttft_s=2.0, tpot_s=0.2))
    assert loose.goodput_rps == pytest.approx(3 / 5.0) and loose.slo_attainment == pytest.approx(3 / 4)
    with pytest.raises(ValueError, match="per-request records"):
        sb.with_slo(sb.replace(p, per_request=()), SLO)
    # --summarize re-scores saved files against the SLO flags.
    out = tmp_path / "out"
    out.mkdir()
    doc = {"slo": sb.asdict(SLO), "points": [sb.asdict(p)]}
    sb.config_file(out, "agg").write_text(json.dumps(doc))
    assert sb.main(["--summarize", "--out", str(out), "--slo-ttft-s", "2", "--slo-tpot-ms", "200"]) == 0
    summary = json.loads((out / sb.SUMMARY_FILE).read_text())
    assert summary["slo"] == {"ttft_s": 2.0, "tpot_s": 0.2}
    assert summary["max_goodput_rps"]["agg"] == pytest.approx(3 / 5.0)
    assert "TTFT <= 2 s" in capsys.readouterr().out


def test_node_load_from_counter_deltas_with_and_without_transfer_counters():
    before = {"steps": 10, "step_s": 1.0, "prompt": 100, "decode": 50, "reads": 2, "read_bytes": 1e9, "read_s": 0.01,
              "descs": 6, "eager": 4, "gpu_s": 0.5}
    after = {"steps": 30, "step_s": 3.0, "prompt": 500, "decode": 250, "reads": 6, "read_bytes": 3e9, "read_s": 0.03,
             "descs": 30, "eager": 9, "gpu_s": 2.1}
    ld = sb.node_load(before, after, window_s=4.0)
    assert ld.eager_steps == 5  # of 20: the other 15 replayed CUDA graphs
    assert ld.gpu_busy == pytest.approx(0.4)  # 1.6 s of GPU time in 4 s, the loop busy for 2 s of them
    assert (ld.steps, ld.busy, ld.step_ms, ld.prompt_tok_s, ld.decode_tok_s) == (20, 0.5, 100.0, 100.0, 50.0)
    assert ld.transfers == 4 and ld.transfer_gbps == pytest.approx(100.0)
    assert ld.descriptors_per_transfer == pytest.approx(6.0)  # 24 descriptors over 4 READs
    # A node without a transfer agent (or counters scraped before they existed): no READs, no division by zero.
    core = {k: before[k] for k in ("steps", "step_s", "prompt", "decode")}
    ld = sb.node_load(core, {**core, "steps": 11, "step_s": 1.5}, window_s=1.0)
    assert (ld.transfers, ld.transfer_gbps, ld.descriptors_per_transfer, ld.gpu_busy) == (0, 0.0, 0.0, 0.0)
    # Files written before the fields existed load with their defaults.
    old = {"steps": 1, "busy": 0.5, "step_ms": 2.0, "prompt_tok_s": 3.0, "decode_tok_s": 4.0}
    assert sb.NodeLoad(**old).transfers == 0


def test_node_gauges_sampled_over_a_point():
    text = ("# HELP baton_node_waiting_requests Requests waiting\n# TYPE baton_node_waiting_requests gauge\n"
            "baton_node_waiting_requests 3.0\nbaton_node_state_used_slots 24.0\n"
            "baton_node_state_total_slots 128.0\nbaton_node_info{role=\"prefill\",engine_id=\"e\"} 1.0\n")
    g = sb.node_gauges(text)
    assert g == {"waiting": 3.0, "slots_used": 24.0, "slots_total": 128.0, "held": 0.0}  # no held leases: 0
    samples = [g, {**g, "waiting": 1.0, "slots_used": 96.0, "held": 7.0}, {**g, "slots_total": 0.0}]
    core = {"steps": 0, "step_s": 0.0, "prompt": 0, "decode": 0}
    ld = sb.node_load(core, {**core, "steps": 4, "step_s": 0.4}, 1.0, samples)
    assert ld.mean_waiting == pytest.approx(7 / 3)
    assert ld.peak_state_slots == pytest.approx(0.75) and ld.peak_held_leases == 7 and ld.gauge_samples == 3
    ld = sb.node_load(core, core, 1.0)  # no samples (a point shorter than the interval)
    assert (ld.mean_waiting, ld.peak_state_slots, ld.peak_held_leases) == (0.0, 0.0, 0)


def test_gauge_sampler_scrapes_until_the_block_ends_and_skips_failures(monkeypatch):
    calls = []

    def scrape(url):
        calls.append(url)
        if url == "bad":
            raise OSError("connection refused")
        return "baton_node_waiting_requests 2\n"

    monkeypatch.setattr(sb, "_scrape", scrape)
    with sb.GaugeSampler({"a": "good", "b": "bad"}, interval_s=0.01) as g:
        time.sleep(0.2)
    n = len(calls)
    time.sleep(0.05)
    assert len(calls) == n  # stopped with the block
    assert len(g.samples["a"]) >= 3 and g.samples["b"] == []
    assert g.samples["a"][0]["waiting"] == 2.0


def test_summary_ratio_and_json_round_trip():
    a = [sb.rate_point("agg", r, 5.0, [_result(0, 0.0, 0.5, [0.05] * 4)] * int(r * 5), SLO) for r in (1.0, 2.0)]
    d = [sb.rate_point("disagg", r, 5.0, [_result(0, 0.0, 0.5, [0.05] * 4)] * int(r * 10), SLO) for r in (1.0, 2.0)]
    s = sb.summary_of({"agg": a, "disagg": d})
    assert s.max_goodput_rps == {"agg": pytest.approx(2.0), "disagg": pytest.approx(4.0)}
    assert s.goodput_ratio == pytest.approx(2.0)
    assert sb.summary_of({"disagg": d}).goodput_ratio is None
    p = json.loads(json.dumps(sb.asdict(a[1])))
    assert sb.point_from_json(p) == a[1]


def test_slo_sweep_scores_each_tpot_bound_from_the_same_requests(tmp_path, capsys):
    # agg: fast first tokens, slow decode (TPOT 0.03 s); disagg: the other way round (TPOT 0.01 s, half the
    # requests' TTFT over the bound). Which wins depends on the TPOT bound, and the sweep shows where.
    agg = [sb.rate_point("agg", 1.0, 5.0, [_result(i, float(i), 0.1, [0.03] * 5) for i in range(4)], SLO)]
    disagg = [sb.rate_point("disagg", 1.0, 5.0, [_result(i, float(i), 0.1 if i % 2 else 1.5, [0.01] * 5)
                                                for i in range(4)], SLO)]
    rows = sb.slo_sweep({"agg": agg, "disagg": disagg}, 1.0, (5.0, 20.0, 50.0))
    assert [r.tpot_ms for r in rows] == [5.0, 20.0, 50.0]
    assert [r.max_goodput_rps["agg"] for r in rows] == pytest.approx([0.0, 0.0, 4 / 5.0])
    assert [r.max_goodput_rps["disagg"] for r in rows] == pytest.approx([0.0, 2 / 5.0, 2 / 5.0])
    assert [r.goodput_ratio for r in rows] == [None, None, pytest.approx(0.5)]  # no ratio over agg's 0
    # Points without per-request records (files older than the field) give no sweep rather than a wrong one.
    assert sb.slo_sweep({"agg": [sb.replace(agg[0], per_request=())]}, 1.0, (5.0,)) == ()
    # --summarize writes it into the summary and prints it.
    out = tmp_path / "out"
    out.mkdir()
    for name, ps in (("agg", agg), ("disagg", disagg)):
        doc = {"model": {"preset": "tiny", "parameters": 2e6}, "cards": [], "load": sb.asdict(LOAD),
               "slo": sb.asdict(SLO), "points": [sb.asdict(p) for p in ps]}
        sb.config_file(out, name).write_text(json.dumps(doc))
    assert sb.main(["--summarize", "--out", str(out), "--slo-ttft-s", "1", "--slo-sweep-tpot-ms", "20,50"]) == 0
    sweep = json.loads((out / sb.SUMMARY_FILE).read_text())["slo_sweep"]
    assert [(r["tpot_ms"], r["goodput_ratio"]) for r in sweep] == [(20.0, None), (50.0, pytest.approx(0.5))]
    assert "| 50 | 0.800 (1) | 0.400 (1) | 0.50x |" in capsys.readouterr().out
    with pytest.raises(ValueError, match="slo_sweep_tpot_ms"):
        sb.parse_args(["--out", str(out), "--slo-sweep-tpot-ms", "10,-1"])
    # The plots of these files: latency and goodput against load, max goodput against the TPOT bound.
    pytest.importorskip("matplotlib")
    spec = importlib.util.spec_from_file_location("plot_results", _ROOT / "benchmarks" / "plot_results.py")
    pr = importlib.util.module_from_spec(spec)
    sys.modules["plot_results"] = pr  # dataclasses look their module up
    spec.loader.exec_module(pr)
    assert pr._max_goodput(json.loads(sb.config_file(out, "disagg").read_text()), 1.0, 0.02) == pytest.approx(0.4)
    pngs = pr.plot_all(out, tmp_path / "png")
    assert sorted(p.name for p in pngs) == ["serving_goodput.png", "serving_latency.png", "serving_slo_sweep.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)


# ---- GPU pinning ------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("config", "expected"), [
    ("disagg", {"prefill-0": "0,1", "decode-0": "1,0"}),
    ("agg", {"decode-0": "0,1", "decode-1": "1,0"}),
])
def test_each_node_gets_its_gpu_first(tmp_path, config, expected):
    # The environments `Cluster` hands to Popen (tests/test_cluster_gpus.py checks real processes get them).
    cfg = sb.parse_args(["--out", str(tmp_path)])
    c = sb.make_cluster(cfg, sb.cluster_specs(0)[config])
    assert c.node_gpus == (0, 1)
    assert {n: c.node_env(n)["CUDA_VISIBLE_DEVICES"] for n in c.node_names} == expected
    assert {n: c.node_gpu(n) for n in c.node_names} == {k: int(v[0]) for k, v in expected.items()}
    assert c.node_args == ()
    assert sb.make_cluster(sb.parse_args(["--out", str(tmp_path), "--cuda-ipc"]),
                           sb.cluster_specs(0)[config]).node_args == ("--cuda-ipc",)
    # The prefill-queue limit goes to disagg's router only.
    cfg = sb.parse_args(["--out", str(tmp_path), "--disagg-prefill-queue-limit-tokens", "8192"])
    specs = sb.cluster_specs(cfg.disagg_local_prefill_threshold, cfg.disagg_prefill_queue_limit_tokens)
    assert sb.make_cluster(cfg, specs[config]).router_args == (
        ("--prefill-queue-limit-tokens", "8192") if config == "disagg" else ())
    # The decode-node flags go to disagg's decode node only; the aggregated replicas keep --engine-args.
    cfg = sb.parse_args(["--out", str(tmp_path), "--disagg-decode-engine-args", "--max-num-batched-tokens 512"])
    assert cfg.decode_engine_args == ("--max-num-batched-tokens", "512")
    assert sb.make_cluster(cfg, sb.cluster_specs(0)[config]).decode_args == (
        ("--max-num-batched-tokens", "512") if config == "disagg" else ())
    with pytest.raises(ValueError, match="disagg_prefill_queue_limit_tokens: expected >= 0"):
        sb.parse_args(["--out", str(tmp_path), "--disagg-prefill-queue-limit-tokens", "-1"])
    # --gpus 0: nothing pinned, every process inherits the environment.
    c = sb.make_cluster(sb.parse_args(["--out", str(tmp_path), "--gpus", "0"]), sb.cluster_specs(0)[config])
    assert c.node_gpus == () and all(c.node_env(n) is None for n in c.node_names)


# ---- end to end ---------------------------------------------------------------------------------------------

def test_smoke_run_end_to_end(tmp_path, capsys):
    """Both configurations as real processes on the CPU (the script's `main` in this process): every
    request completes, statistics are ordered, goodput <= throughput, and the router routed as each
    configuration means to."""
    out = tmp_path / "out"
    # Rate points shorter than --smoke's still send each rate a few requests, their last arrival after several
    # gauge scrapes.
    assert sb.main(["--smoke", "--out", str(out), "--no-progress",
                    "--prefill-engine-args", "--max-num-batched-tokens 128",
                    "--disagg-decode-engine-args", "--max-num-batched-tokens 96",
                    "--warmup-s", "1", "--duration-s", "2.5"]) == 0
    stdout = capsys.readouterr().out
    assert "disagg / agg max goodput" in stdout
    assert "| engine busy |" in stdout
    for name, route in (("agg", "local_prefill"), ("disagg", "disaggregated")):
        doc = json.loads((out / f"serving_{name}.json").read_text())
        assert doc["config"]["name"] == name
        assert doc["prefill_engine_args"] == ["--max-num-batched-tokens", "128"]
        assert doc["decode_engine_args"] == ["--max-num-batched-tokens", "96"]
        assert [p["offered_rps"] for p in doc["points"]] == [2.0, 4.0]
        routing = doc["routing_including_warmup"]
        assert routing[route] > 0 and sum(routing.values()) == routing[route], routing
        nodes = {"agg": {"decode-0", "decode-1"}, "disagg": {"prefill-0", "decode-0"}}[name]
        for p in doc["points"]:
            assert p["requests"] > 0 and p["completed"] == p["requests"] and p["failed"] == 0, p
            # Each node's engine work over the point, from its /metrics: the nodes that served it did work.
            assert set(p["nodes"]) == nodes
            for n, load in p["nodes"].items():
                assert 0 <= load["busy"] <= 1.5 and load["steps"] >= 0, (n, load)
                assert load["eager_steps"] == load["steps"], (n, load)  # no CUDA graphs on the CPU
            assert sum(ld["decode_tok_s"] for ld in p["nodes"].values()) > 0
            # The router's decisions over the point: one per request, all of this configuration's kind.
            assert p["routing"][route] == p["requests"] and sum(p["routing"].values()) == p["requests"], p["routing"]
            # Gauges sampled while the point ran (every 0.5 s over a few seconds), each a share or a count.
            for n, load in p["nodes"].items():
                assert load["gauge_samples"] >= 2 and 0 <= load["peak_state_slots"] <= 1, (n, load)
                assert load["mean_waiting"] >= 0 and load["peak_held_leases"] >= 0, (n, load)
            if name == "disagg":
                assert p["nodes"]["prefill-0"]["prompt_tok_s"] > 0 and p["nodes"]["prefill-0"]["decode_tok_s"] == 0
                # The decode node's READs over the point (NIXL on the CPU): at least one descriptor per pool.
                reads = p["nodes"]["decode-0"]
                assert reads["transfers"] > 0 and reads["transfer_gbps"] > 0, reads
                assert reads["descriptors_per_transfer"] >= 3, reads
                assert p["nodes"]["prefill-0"]["transfers"] == 0
            assert 0 < p["goodput_rps"] <= p["throughput_rps"]
            assert p["throughput_rps"] <= p["requests"] / doc["load"]["duration_s"] + 1e-9
            for metric in ("ttft_s", "itl_s", "tpot_s", "e2e_s"):
                s = p[metric]
                assert 0 <= s["p50"] <= s["p90"] <= s["p99"], (metric, s)
            assert p["ttft_s"]["p99"] <= p["e2e_s"]["p99"] + 1e-9
    summary = json.loads((out / sb.SUMMARY_FILE).read_text())
    assert set(summary["max_goodput_rps"]) == {"agg", "disagg"} and summary["goodput_ratio"] > 0


def test_serving_variants_script_builds_one_run_per_line():
    """benchmarks/serving_variants.sh (DRY=1: commands only): one serving_bench.py run per variant line, the line's
    engine flags appended to the shared ones, its other flags split as shell words (quotes kept together)."""
    import os
    import shlex

    root = Path(__file__).resolve().parent.parent
    variants = ("a|10,13||--configs agg\n"
                'b|18|--mixed-graph-tokens 256|--configs disagg --disagg-decode-engine-args '
                '"--mixed-graph-tokens 128 --max-num-seqs 64"')
    env = {**os.environ, "DRY": "1", "OUT": "/tmp/o", "VARIANTS": variants}
    out = subprocess.run(["bash", "benchmarks/serving_variants.sh"], cwd=root, env=env, capture_output=True,
                         text=True, check=True).stdout
    cmds = [shlex.split(line) for line in out.splitlines() if line.startswith("python3")]
    assert len(cmds) == 2
    a, b = ({c[i]: c[i + 1] for i in range(2, len(c) - 1) if c[i].startswith("--")} for c in cmds)
    assert a["--out"] == "/tmp/o/a" and a["--rates"] == "10,13" and a["--configs"] == "agg"
    assert a["--engine-args"].endswith("--max-model-len 16384") and a["--slo-tpot-ms"] == "15"
    assert b["--engine-args"].endswith("--max-model-len 16384 --mixed-graph-tokens 256")
    assert b["--disagg-decode-engine-args"] == "--mixed-graph-tokens 128 --max-num-seqs 64"
    assert a["--duration-s"] == b["--duration-s"] == "20"
    env["DURATION_S"] = "60"
    out = subprocess.run(["bash", "benchmarks/serving_variants.sh"], cwd=root, env=env, capture_output=True,
                         text=True, check=True).stdout
    assert all(shlex.split(line)[shlex.split(line).index("--duration-s") + 1] == "60"
               for line in out.splitlines() if line.startswith("python3"))
