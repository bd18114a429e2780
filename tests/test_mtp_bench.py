"""benchmarks/mtp_bench.py at a tiny size on the CPU: its training forward computes what the engine computes
(target and MTP logits at every position, fp32), training lowers both losses, and the script runs end to end."""

from __future__ import annotations

import importlib.util
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


def test_end_to_end_tiny(tmp_path, capsys):
    rc = mb.main(["--device", "cpu", "--steps", "5", "--k-max", "2", "--prompts", "2", "--prompt-len", "16",
                  "--max-tokens", "8", "--corpus-mb", "0.25", "--holdout-every", "4", "--seq-len", "32",
                  "--out", str(tmp_path / "ckpt"), "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0, text
    lines = text.strip().splitlines()
    assert "engine check" in text and "OK" in text
    header = lines.index(next(line for line in lines if line.startswith("| K |")))
    rows = lines[header + 2:]
    assert [r.split("|")[1].strip() for r in rows] == ["0", "1", "2"], text  # the table comes last
    for r in rows:
        assert r.split("|")[-2].strip() == "0/2"  # greedy outputs identical across K (fp32, CPU)
    assert (tmp_path / "ckpt" / "model.safetensors").is_file()
    assert (tmp_path / "ckpt" / "tokenizer.json").is_file()
