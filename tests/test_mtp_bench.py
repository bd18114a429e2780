"""benchmarks/mtp_bench.py at a tiny size on the CPU: its training forward computes what the engine computes
(target and MTP logits at every position, fp32), training lowers both losses, and the script runs end to end."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from baton.engine.loader import load_checkpoint
from baton.engine.tokenizer import load_tokenizer

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "mtp_bench.py"
_spec = importlib.util.spec_from_file_location("mtp_bench", _PATH)
mb = importlib.util.module_from_spec(_spec)
sys.modules["mtp_bench"] = mb  # dataclasses look their module up
_spec.loader.exec_module(mb)

CPU = torch.device("cpu")

# Variations around the tiny preset: groups, conv width, chunking, biases, tied head, MTP block patterns.
CONFIGS = {
    "tiny *-": {},
    "groups1 conv3 bias tied *": {"n_groups": 1, "conv_kernel": 3, "chunk_size": 8, "use_bias": True,
                                  "mlp_bias": True, "tie_word_embeddings": True, "mtp_hybrid_override_pattern": "*"},
    "attn-first -*-": {"hybrid_override_pattern": "*M-M", "num_key_value_heads": 4, "mlp_hidden_act": "silu",
                       "mtp_hybrid_override_pattern": "-*-"},
}


def perturbed(weights: dict[str, torch.Tensor], seed: int = 0) -> dict[str, torch.Tensor]:
    """make_model's weights with noise on every 1-D tensor: norms (1), biases (0) and D (1) must matter too."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.2 * torch.randn(v.shape, generator=g) if v.dim() == 1 else v.clone() for k, v in weights.items()}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_training_forward_matches_engine(tmp_path, name):
    overrides = {"mtp_hybrid_override_pattern": "*-", **CONFIGS[name]}
    cfg, weights = mb.init_checkpoint(tmp_path / "ckpt", "tiny", overrides)
    params = perturbed(weights)
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(3, cfg.vocab_size, (42,), generator=g).tolist()  # 41 positions: chunks of 16 + a tail
    err_t, err_m = mb.check_against_engine(params, cfg, seq, CPU, tol=1e-5)
    assert err_t < 1e-5 and err_m < 1e-5

    # The check does catch a wrong MTP weight (the engine loads something else than was trained).
    bad = dict(params)
    bad["mtp.layers.0.eh_proj.weight"] = bad["mtp.layers.0.eh_proj.weight"] * 1.1
    with pytest.raises(AssertionError, match="mtp logits"):
        mb.check_against_engine(params, cfg, seq, CPU, weights=bad, tol=1e-5)


def test_saved_checkpoint_loads_and_matches(tmp_path):
    out = tmp_path / "ckpt"
    cfg, weights = mb.init_checkpoint(out, "tiny", {"mtp_hybrid_override_pattern": "*-"})
    params = perturbed(weights, seed=3)
    mb.save_weights(out, params)
    cfg2, loaded = load_checkpoint(out, "float32")
    assert cfg2 == cfg and set(loaded) == set(params)
    assert all(torch.equal(loaded[k], params[k]) for k in params)
    seq = list(range(3, 40))
    mb.check_against_engine(params, cfg2, seq, CPU, weights=loaded, tol=1e-5)


def test_training_lowers_both_losses(tmp_path):
    out = tmp_path / "ckpt"
    cfg, weights = mb.init_checkpoint(out, "tiny", {"mtp_hybrid_override_pattern": "*-"})
    train_texts, _ = mb.stdlib_sources(128 * 1024, 10)
    stream = mb.token_stream(train_texts, load_tokenizer(out), cfg.eos_token_ids[0])
    params = {k: v.requires_grad_(True) for k, v in weights.items()}
    eval_stream = stream[:4096]
    before = mb.evaluate(params, cfg, eval_stream, 32, 8, CPU, max_batches=2)
    res = mb.train(params, cfg, stream, steps=12, seconds=None, batch_size=4, seq_len=32, lr=3e-3, warmup=2,
                   mtp_weight=0.3, device=CPU, log_every=100, progress=False)
    after = mb.evaluate(params, cfg, eval_stream, 32, 8, CPU, max_batches=2)
    assert res.steps == 12 and res.tokens == 12 * 4 * 32
    assert after[0] < before[0] - 0.5, (before, after)  # target CE
    assert after[1] < before[1] - 0.5, (before, after)  # MTP CE


def table_rows(lines: list[str], header_start: str) -> list[list[str]]:
    """The cells of the markdown table whose header line starts with `header_start`, up to its end."""
    header = lines.index(next(line for line in lines if line.startswith(header_start)))
    rows = []
    for line in lines[header + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.split("|")[1:-1]])
    return rows


def test_end_to_end_tiny(tmp_path, capsys):
    rc = mb.main(["--device", "cpu", "--steps", "5", "--k-max", "2", "--prompts", "2", "--prompt-len", "16",
                  "--max-tokens", "8", "--corpus-mb", "0.25", "--holdout-every", "4", "--seq-len", "32",
                  "--out", str(tmp_path / "ckpt"), "--no-progress", "--json", str(tmp_path / "out.json")])
    text = capsys.readouterr().out
    assert rc == 0, text
    lines = text.strip().splitlines()
    assert "engine check" in text and "OK" in text
    rows = table_rows(lines, "| K |")
    assert [r[0] for r in rows] == ["0", "1", "2"], text
    for r in rows:
        assert r[-1] == "0/2"  # greedy outputs identical across K (fp32, CPU)
    assert (tmp_path / "ckpt" / "model.safetensors").is_file()
    assert (tmp_path / "ckpt" / "tokenizer.json").is_file()

    # The SSM state dtype section comes last: one row per low-precision dtype, against fp32.
    assert "### SSM state dtype" in text
    state_rows = table_rows(lines, "| SSM state |")
    assert [r[0] for r in state_rows] == ["bfloat16", "float16"], text
    assert lines[-1].startswith("| float16 |")
    summary = json.loads((tmp_path / "out.json").read_text())
    assert [r["k"] for r in summary["mtp"]] == [0, 1, 2]
    st = summary["ssm_state_dtype"]
    assert st["reference"] == "float32" and st["config"]["window"] == 32 and st["config"]["prefix"] == 16
    for f, g in zip(st["forced"], st["greedy"], strict=True):
        assert f["positions"] == 4 * (32 - 16 - 1)
        assert math.isfinite(f["nll"]) and math.isfinite(f["ref_nll"]) and f["mean_kl"] >= 0
        assert g["prompts"] == 2 and 0 <= g["identical"] <= 2


def test_end_to_end_skips_state_dtype(tmp_path, capsys):
    rc = mb.main(["--device", "cpu", "--steps", "2", "--k-max", "0", "--prompts", "1", "--prompt-len", "8",
                  "--max-tokens", "4", "--corpus-mb", "0.25", "--holdout-every", "4", "--seq-len", "32",
                  "--out", str(tmp_path / "ckpt"), "--no-progress", "--no-state-dtype"])
    text = capsys.readouterr().out
    assert rc == 0 and "SSM state" not in text, text


# ---- SSM state dtype section ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A tiny random checkpoint (perturbed norms, so every layer matters) and a few token sequences."""
    cfg, weights = mb.init_checkpoint(tmp_path_factory.mktemp("state") / "ckpt", "tiny",
                                      {"mtp_hybrid_override_pattern": "*-"})
    g = torch.Generator().manual_seed(5)
    windows = torch.randint(3, cfg.vocab_size, (3, 40), generator=g).tolist()
    prompts = torch.randint(3, cfg.vocab_size, (3, 7), generator=g).tolist()
    return cfg, perturbed(weights, seed=2), windows, prompts


def state_config(dtypes: tuple[str, ...], **kw) -> mb.StateDtypeConfig:
    return mb.StateDtypeConfig(dtypes=dtypes, **{"num_windows": 3, "window": 40, "prefix": 16, "greedy_tokens": 24,
                                                 **kw})


def test_forced_decode_matches_prefill(tiny_model):
    """Teacher forcing through the decode path (fp32 state) computes what one prefill of the window does, at
    every decode position: the forced tokens are the window's, in order."""
    cfg, weights, windows, _ = tiny_model
    engine = mb.make_engine(cfg, weights, CPU, "float32", len(windows), 40, ssm_state_dtype="float32")
    forced = mb.forced_decode_logits(engine, windows, 16)
    assert forced.shape == (3, 40 - 16 - 1, cfg.vocab_size)
    for w, seq in enumerate(windows):
        prefill, _ = mb.engine_logits(cfg, weights, seq, CPU)  # [39, V]: positions 0..38
        ref = prefill[16:]
        err = ((forced[w] - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-5, (w, err)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_state_dtype_negative_control(tiny_model, dtype):
    """A dtype against itself: exactly zero divergence and identical greedy outputs."""
    cfg, weights, windows, prompts = tiny_model
    res = mb.compare_state_dtypes(cfg, weights, windows, prompts, state_config((dtype,)), CPU, reference=dtype)
    (f,), (g,) = res.forced, res.greedy
    assert f.positions == 3 * 23
    assert f.nll == f.ref_nll and f.nll_delta == 0 and f.ppl_increase == 0
    assert f.max_rel_logit_err == 0 and f.mean_rel_logit_err == 0 and f.mean_kl == 0 and f.argmax_agreement == 1
    assert g.identical == g.prompts == 3 and g.identical_fraction == 1 and g.mean_first_difference is None


def test_low_precision_state_costs_a_little(tiny_model):
    cfg, weights, windows, prompts = tiny_model
    res = mb.compare_state_dtypes(cfg, weights, windows, prompts, state_config(("bfloat16", "float16")), CPU)
    assert res.reference == "float32" and [f.dtype for f in res.forced] == ["bfloat16", "float16"]
    bf16, fp16 = res.forced
    for f in res.forced:
        assert all(math.isfinite(x) for x in (f.nll, f.ref_nll, f.max_rel_logit_err, f.mean_kl))
        assert 0 < f.mean_rel_logit_err <= f.max_rel_logit_err < 0.05, f
        assert 0 < f.mean_kl < 1e-3, f
        assert abs(f.nll_delta) < 0.01 and f.argmax_agreement > 0.9, f
    # fp16 keeps 3 more mantissa bits than bf16 (the tiny model's states are well inside fp16's range).
    assert fp16.mean_rel_logit_err < bf16.mean_rel_logit_err
    for g in res.greedy:
        assert g.prompts == 3 and len(g.first_differences) == 3 - g.identical
        assert all(0 <= i < 24 for i in g.first_differences)
    table = mb.state_dtype_table(res).splitlines()
    assert len(table) == 4 and table[2].startswith("| bfloat16 |") and table[3].startswith("| float16 |")
    summary = json.loads(json.dumps(mb.state_dtype_summary(res)))
    assert summary["forced"][0]["dtype"] == "bfloat16" and summary["config"]["dtypes"] == ["bfloat16", "float16"]


def test_compare_greedy_first_difference():
    g = mb.compare_greedy("bfloat16", [[1, 2, 3], [1, 2, 3], [4, 5]], [[1, 2, 3], [1, 9, 3], [4]])
    assert (g.identical, g.first_differences, g.mean_first_difference) == (1, (1, 1), 1.0)


@pytest.mark.parametrize("kw, match", [
    ({"dtypes": ("float64",)}, "--state-dtypes: expected distinct dtypes among float32, bfloat16, float16, got float64"),
    ({"dtypes": ()}, "--state-dtypes: expected .* got none"),
    ({"dtypes": ("bfloat16", "bfloat16")}, "--state-dtypes: expected distinct"),
    ({"window": 17}, "--state-window: expected >= --state-prefix \\+ 2 = 18 .* got 17"),
    ({"prefix": 0}, "--state-prefix: expected >= 1, got 0"),
    ({"num_windows": 0}, "--state-windows: expected >= 1, got 0"),
    ({"greedy_tokens": 0}, "--state-greedy-tokens: expected >= 1, got 0"),
])
def test_state_dtype_config_rejects_bad_flags(kw, match):
    with pytest.raises(ValueError, match=match):
        state_config(**{"dtypes": ("bfloat16",), **kw})


def test_bad_state_flag_fails_before_training(tmp_path):
    assert mb.parse_state_dtypes(" bfloat16, float16 ,") == ("bfloat16", "float16")
    with pytest.raises(ValueError, match="--state-dtypes: expected .* got bf16"):
        mb.main(["--device", "cpu", "--state-dtypes", "bf16", "--out", str(tmp_path / "ckpt")])
    assert not (tmp_path / "ckpt").exists()


def test_benchmark_captures_every_graph_size_before_timing(tmp_path, monkeypatch):
    """Each K's engine captures its graphs before its warm-up and timed run (as a server does), so that no timed
    step pays a capture when the batch shrinks to a size the warm-up never ran."""
    calls: list[int] = []
    real = mb.LLMEngine.capture_graphs
    real_run = mb.run_greedy

    def capture(engine, sampled_verify=True):
        assert not sampled_verify  # greedy rows only: the verify graphs of sampling rows are left out
        calls.append(engine.config.num_speculative_tokens)
        return real(engine, sampled_verify)

    def run(engine, *args):
        assert calls and calls[-1] == engine.config.num_speculative_tokens, "a step ran before the capture"
        return real_run(engine, *args)

    monkeypatch.setattr(mb.LLMEngine, "capture_graphs", capture)
    monkeypatch.setattr(mb, "run_greedy", run)
    out = tmp_path / "ckpt"
    mb.make_model(out, preset="tiny", mtp_layers=1, overrides={"mtp_hybrid_override_pattern": "*-"}, progress=False)
    rows = mb.benchmark(out, [[5, 6, 7, 8], [9, 10, 11]], [0, 1, 2], 6, CPU, "float32", progress=False)
    assert calls == [0, 1, 2] and [r.k for r in rows] == [0, 1, 2]
