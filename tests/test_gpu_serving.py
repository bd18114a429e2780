"""`baton up` on a GPU with no flag but the model, as a user starts it: the 8b-like model with an MTP layer serves a few
hundred concurrent requests with K = 0..3 draft tokens, and every request completes (with drafts on, a metrics
hook once raised on the decode node's engine thread and every request after it failed). The table lands in
benchmarks/RESULTS.md; BATON_SERVE_MODEL names a checkpoint to reuse, else the test builds one."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from baton.engine.make_model import make_model
from benchmarks.serve_check import Load, run_variant

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model_8b(tmp_path_factory) -> str:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if given := os.environ.get("BATON_SERVE_MODEL"):
        return given
    out = tmp_path_factory.mktemp("serve") / "8b-like"
    make_model(out, "8b-like", mtp_layers=1, seed=0, device="cuda", progress=False)
    return str(out)


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_baton_up_serves_every_request_with_k_drafts(model_8b, tmp_path, k):
    vocab = json.loads((Path(model_8b) / "config.json").read_text())["vocab_size"]
    load = Load(requests=320, concurrency=256, prompt_min=64, prompt_max=1024, max_tokens=64, vocab=vocab, seed=k)
    r = run_variant(model_8b, f"k{k}", f"--speculative-tokens {k}" if k else "", load, tmp_path)
    print(f"\nK={k}: {r.completed}/{r.requests} completed, TTFT p50 {r.ttft_p50_s:.2f} s p99 {r.ttft_p99_s:.2f} s, "
          f"TPOT {r.tpot_mean_ms:.1f} ms, {r.output_tokens_per_s:.0f} output tok/s, wall {r.wall_s:.1f} s, "
          f"start {r.startup_s:.0f} s; observer errors {r.metrics.get('decode.baton_node_observer_errors_total')}")
    if out := os.environ.get("BATON_RESULTS_DIR"):
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"baton_up_k{k}.json").write_text(json.dumps(r.__dict__ | {"load": load.__dict__}, indent=1))
    assert r.completed == r.requests, (r.errors, r.log_tail[-3000:])
    assert r.metrics.get("decode.baton_node_observer_errors_total") == 0
    # The default on one GPU: aggregated, so the decode node took every prompt.
    assert r.metrics["decode.baton_node_prompt_tokens_total"] > 0
