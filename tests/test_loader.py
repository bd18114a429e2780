"""`load_checkpoint`: canonical names, dtypes, sharding, legacy names and clear errors."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from baton.engine.loader import load_checkpoint
from baton.engine.make_model import make_model
from baton.engine.weights import canonicalize_names, expected_weight_shapes


@pytest.fixture(scope="module")
def tiny_mtp(tmp_path_factory):
    """tiny with an MoE layer in the target and one "*E" MTP step."""
    return make_model(tmp_path_factory.mktemp("ckpt") / "tiny", "tiny", mtp_layers=1,
                      overrides={"hybrid_override_pattern": "M*ME-"}, progress=False)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_config(path, **changes):
    d = json.loads((path / "config.json").read_text())
    d.update(changes)
    (path / "config.json").write_text(json.dumps(d))


def _rewrite_weights(path, fn):
    state = load_file(path / "model.safetensors")
    save_file(fn(state), path / "model.safetensors", metadata={"format": "pt"})


def test_loads_canonical_names_and_shapes(tiny_mtp):
    cfg, state = load_checkpoint(tiny_mtp)
    assert cfg.pattern == "M*ME-" and cfg.num_nextn_predict_layers == 1
    assert {k: tuple(v.shape) for k, v in state.items()} == expected_weight_shapes(cfg)
    assert all(v.dtype == torch.float32 for v in state.values())
    assert state["mtp.layers.0.eh_proj.weight"].shape == (64, 128)


def test_matches_hf_weights(tiny_mtp):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_mtp)
    _, state = load_checkpoint(tiny_mtp)
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dtype_conversion_keeps_router_fp32(tiny_mtp, dtype):
    cfg, state = load_checkpoint(tiny_mtp, dtype=dtype)
    assert cfg.torch_dtype == dtype
    for k, v in state.items():
        want = torch.float32 if ".gate." in k else getattr(torch, dtype)
        assert v.dtype == want, k
    _, ref = load_checkpoint(tiny_mtp)
    assert torch.equal(state["lm_head.weight"], ref["lm_head.weight"].to(getattr(torch, dtype)))
    assert torch.equal(state["model.layers.3.mixer.gate.weight"], ref["model.layers.3.mixer.gate.weight"])


def test_default_dtype_is_config_dtype(tmp_path):
    out = make_model(tmp_path / "bf16", "tiny", dtype="bfloat16", progress=False)
    cfg, state = load_checkpoint(out)
    assert cfg.torch_dtype == "bfloat16" and state["model.embeddings.weight"].dtype == torch.bfloat16
    cfg32, state32 = load_checkpoint(out, dtype="float32")
    assert cfg32.torch_dtype == "float32" and state32["model.embeddings.weight"].dtype == torch.float32
    with pytest.raises(ValueError, match="dtype"):
        load_checkpoint(out, dtype="int8")


def test_sharded_round_trip_is_bit_exact(tmp_path, tiny_mtp):
    sharded = make_model(tmp_path / "sharded", "tiny", mtp_layers=1, overrides={"hybrid_override_pattern": "M*ME-"},
                         shard_size_bytes=100_000, progress=False)
    assert len(list(sharded.glob("model-*.safetensors"))) > 2
    _, a = load_checkpoint(tiny_mtp)
    _, b = load_checkpoint(sharded)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _to_legacy(state):
    out = {}
    for k, v in state.items():
        k = "backbone." + k[len("model."):] if k.startswith("model.") else k
        if k.endswith(("experts.up_proj", "experts.down_proj")):
            base, proj = k.rsplit(".", 1)
            out.update({f"{base}.{j}.{proj}.weight": v[j].clone() for j in range(v.shape[0])})
        else:
            out[k] = v
    return out


def test_legacy_backbone_and_per_expert_names(tmp_path, tiny_mtp):
    legacy = _copy(tiny_mtp, tmp_path / "legacy")
    _rewrite_weights(legacy, _to_legacy)
    names = load_file(legacy / "model.safetensors").keys()
    assert "backbone.layers.3.mixer.experts.0.up_proj.weight" in names
    assert "mtp.layers.1.mixer.experts.3.down_proj.weight" in names
    _, ref = load_checkpoint(tiny_mtp)
    _, got = load_checkpoint(legacy)
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)


def test_canonicalize_names_errors():
    w = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"experts 0\.\.2.*missing \[1\]"):
        canonicalize_names({"model.layers.0.mixer.experts.0.up_proj.weight": w,
                            "model.layers.0.mixer.experts.2.up_proj.weight": w})
    with pytest.raises(ValueError, match="model.norm_f.weight"):
        canonicalize_names({"backbone.norm_f.weight": w, "model.norm_f.weight": w})
    assert canonicalize_names({"backbone.embeddings.weight": w}).keys() == {"model.embeddings.weight"}


def test_mtp_weights_ignored_when_config_has_no_mtp(tmp_path, tiny_mtp, caplog):
    plain = _copy(tiny_mtp, tmp_path / "plain")
    _edit_config(plain, num_nextn_predict_layers=0)
    with caplog.at_level(logging.WARNING):
        cfg, state = load_checkpoint(plain)
    assert not any(k.startswith("mtp.") for k in state)
    assert state.keys() == expected_weight_shapes(cfg).keys()
    assert "mtp" in caplog.text


def test_missing_mtp_weights_are_an_error(tmp_path):
    out = make_model(tmp_path / "m", "tiny", progress=False)
    _edit_config(out, num_nextn_predict_layers=1, mtp_hybrid_override_pattern="*-")
    with pytest.raises(ValueError, match=r"missing: .*mtp\.layers\.0\.eh_proj\.weight"):
        load_checkpoint(out)


def test_tied_embeddings(tmp_path):
    out = make_model(tmp_path / "tied", "tiny", overrides={"tie_word_embeddings": True}, progress=False)
    assert "lm_head.weight" not in load_file(out / "model.safetensors")
    cfg, state = load_checkpoint(out)
    assert cfg.tie_word_embeddings and "lm_head.weight" not in state
    assert state.keys() == expected_weight_shapes(cfg).keys()
    # A stored lm_head.weight in a tied checkpoint is ignored, not an error.
    _rewrite_weights(out, lambda s: {**s, "lm_head.weight": s["model.embeddings.weight"].clone()})
    assert "lm_head.weight" not in load_checkpoint(out)[1]


@pytest.mark.parametrize(("changes", "field"), [
    ({"model_type": "llama"}, "model_type"),
    ({"hybrid_override_pattern": "M*Q-"}, "hybrid_override_pattern"),
    ({"mlp_hidden_act": "swish"}, "mlp_hidden_act"),
    ({"torch_dtype": "int4"}, "torch_dtype"),
])
def test_bad_config_field_is_named(tmp_path, tiny_mtp, changes, field):
    bad = _copy(tiny_mtp, tmp_path / "bad")
    _edit_config(bad, **changes)
    with pytest.raises(ValueError, match=field):
        load_checkpoint(bad)


def test_missing_or_broken_files(tmp_path, tiny_mtp):
    with pytest.raises(ValueError, match="config.json"):
        load_checkpoint(tmp_path / "nowhere")
    broken = _copy(tiny_mtp, tmp_path / "broken")
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json.*JSON"):
        load_checkpoint(broken)
    (broken / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        load_checkpoint(broken)
    noweights = _copy(tiny_mtp, tmp_path / "noweights")
    (noweights / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="model.safetensors"):
        load_checkpoint(noweights)
    badindex = make_model(tmp_path / "badindex", "tiny", shard_size_bytes=100_000, progress=False)
    next(badindex.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(ValueError, match="model-00002-of"):
        load_checkpoint(badindex)


def test_missing_unexpected_and_mismatched_weights_are_listed(tmp_path, tiny_mtp):
    missing = _copy(tiny_mtp, tmp_path / "missing")
    _rewrite_weights(missing, lambda s: {k: v for k, v in s.items() if k != "model.layers.1.mixer.k_proj.weight"})
    with pytest.raises(ValueError, match=r"1 missing: model\.layers\.1\.mixer\.k_proj\.weight"):
        load_checkpoint(missing)

    extra = _copy(tiny_mtp, tmp_path / "extra")
    _rewrite_weights(extra, lambda s: {**s, "model.layers.0.mixer.bogus": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"1 unexpected: model\.layers\.0\.mixer\.bogus"):
        load_checkpoint(extra)

    shapes = _copy(tiny_mtp, tmp_path / "shapes")
    _edit_config(shapes, intermediate_size=128)
    with pytest.raises(ValueError, match=r"model\.layers\.4\.mixer\.up_proj\.weight expected \[128, 64\] got \[256, 64\]"):
        load_checkpoint(shapes)

    many = _copy(tiny_mtp, tmp_path / "many")
    _edit_config(many, vocab_size=100, hybrid_override_pattern="M*ME-M", num_hidden_layers=6)
    with pytest.raises(ValueError) as err:
        load_checkpoint(many)
    msg = str(err.value)
    assert "missing: model.layers.5." in msg and "wrong shape" in msg and "lm_head.weight" in msg
