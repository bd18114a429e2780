"""`make_model` presets against HF transformers' NemotronHForCausalLM (the reference)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil

import pytest
import torch
from safetensors import safe_open

from baton.cli import make_model_cmd
from baton.engine.config import ModelConfig
from baton.engine.make_model import (
    KNOWN_CONFIG_KEYS,
    build_config,
    make_model,
    parse_overrides,
)
from baton.engine.weights import expected_weight_shapes, num_parameters

transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()


def _file_shapes(out) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for f in sorted(out.glob("model*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                shapes[k] = tuple(sf.get_slice(k).get_shape())
    return shapes


def _hf_load(out):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model


def _non_mtp(shapes: dict) -> dict:
    return {k: v for k, v in shapes.items() if not k.startswith("mtp.")}


@pytest.mark.parametrize(("preset", "mtp_layers", "overrides"), [
    ("tiny", 0, {}),
    ("tiny", 1, {}),
    ("tiny", 2, {"hybrid_override_pattern": "ME*-M", "moe_latent_size": 32, "mlp_bias": True}),
    ("small", 1, {}),
])
def test_preset_loads_in_hf_with_expected_names(tmp_path, preset, mtp_layers, overrides):
    out = make_model(tmp_path / preset, preset, mtp_layers=mtp_layers, overrides=overrides, progress=False)
    cfg = ModelConfig.from_hf_dict(json.loads((out / "config.json").read_text()))
    expected = expected_weight_shapes(cfg)
    assert _file_shapes(out) == expected
    model = _hf_load(out)
    hf = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert hf == expected_weight_shapes(cfg, include_mtp=False) == _non_mtp(expected)
    assert any(k.startswith("mtp.") for k in expected) == (mtp_layers > 0)


@pytest.mark.parametrize("overrides", [
    {"hybrid_override_pattern": "M*E-", "moe_latent_size": 24, "mlp_bias": True},
    {"use_bias": True, "mamba_proj_bias": True, "use_conv_bias": False},
    {"layers_block_type": ["mlp", "linear_attention", "full_attention", "moe"]},
    {"num_key_value_heads": 4, "head_dim": 8, "n_routed_experts": 6, "num_experts_per_tok": 3,
     "hybrid_override_pattern": "E*M"},
])
def test_expected_shapes_equal_hf_state_dict(overrides):
    d = build_config("tiny", overrides=overrides)
    cfg = ModelConfig.from_hf_dict(d)
    model = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**d))
    hf = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert hf == expected_weight_shapes(cfg)


def test_tied_embeddings_have_no_lm_head():
    cfg = ModelConfig.from_hf_dict(build_config("tiny", overrides={"tie_word_embeddings": True}))
    shapes = expected_weight_shapes(cfg)
    assert "lm_head.weight" not in shapes and "model.embeddings.weight" in shapes


def test_mtp_names_follow_real_checkpoints():
    cfg = ModelConfig.from_hf_dict(build_config("tiny", mtp_layers=2))
    assert cfg.mtp_layer_types == ("*", "E")
    h = cfg.hidden_size
    mtp = {k: v for k, v in expected_weight_shapes(cfg).items() if k.startswith("mtp.")}
    for first, last in ((0, 1), (2, 3)):
        assert mtp[f"mtp.layers.{first}.enorm.weight"] == (h,)
        assert mtp[f"mtp.layers.{first}.hnorm.weight"] == (h,)
        assert mtp[f"mtp.layers.{first}.eh_proj.weight"] == (h, 2 * h)
        assert mtp[f"mtp.layers.{first}.mixer.q_proj.weight"] == (cfg.num_attention_heads * cfg.head_dim, h)
        assert mtp[f"mtp.layers.{last}.final_layernorm.weight"] == (h,)
        assert mtp[f"mtp.layers.{last}.mixer.experts.up_proj"] == (
            cfg.n_routed_experts, cfg.moe_intermediate_size, h)
        assert mtp[f"mtp.layers.{last}.mixer.gate.e_score_correction_bias"] == (cfg.n_routed_experts,)
        assert f"mtp.layers.{first}.final_layernorm.weight" not in mtp
        assert f"mtp.layers.{last}.enorm.weight" not in mtp
        assert mtp[f"mtp.layers.{first}.norm.weight"] == mtp[f"mtp.layers.{last}.norm.weight"] == (h,)
    assert not any(k.startswith("mtp.layers.4") for k in mtp)


def test_mtp_config_accepted_by_hf():
    d = build_config("tiny", mtp_layers=1, overrides={"mtp_hybrid_override_pattern": "*-"})
    hf = transformers.NemotronHConfig(**d)
    assert hf.num_nextn_predict_layers == 1 and hf.mtp_layers_block_type == ["full_attention", "mlp"]
    assert ModelConfig.from_hf_dict(d).mtp_layer_types == ("*", "-")


def test_overrides(tmp_path):
    out = make_model(tmp_path / "m", "tiny", overrides=parse_overrides(
        ["vocab_size=8", "hybrid_override_pattern=M*M", "tie_word_embeddings=false", "layer_norm_epsilon=1e-6"]),
        progress=False)
    d = json.loads((out / "config.json").read_text())
    assert d["vocab_size"] == 8 and d["hybrid_override_pattern"] == "M*M" and d["num_hidden_layers"] == 3
    model = _hf_load(out)
    assert model.config.layers_block_type == ["linear_attention", "full_attention", "linear_attention"]
    assert model.lm_head.weight.shape == (8, 64)


def test_legacy_override_key_is_renamed():
    d = build_config("tiny", overrides={"mamba_n_groups": 4})
    assert d["n_groups"] == 4 and "mamba_n_groups" not in d
    assert transformers.NemotronHConfig(**d).n_groups == ModelConfig.from_hf_dict(d).n_groups == 4


def test_unknown_override_key_is_refused_but_hf_keys_pass():
    with pytest.raises(ValueError, match="not_a_field"):
        build_config("tiny", overrides={"not_a_field": 1})
    assert build_config("tiny", overrides={"moe_shared_expert_overlap": False})["moe_shared_expert_overlap"] is False


def test_known_keys_cover_hf_config():
    hf_keys = set(transformers.NemotronHConfig.__annotations__) | set(transformers.NemotronHConfig().to_dict())
    assert hf_keys - {"_name_or_path"} <= KNOWN_CONFIG_KEYS


def test_parse_overrides():
    assert parse_overrides(["a=8", "b=M*M", "c=true", "d=[1, 2]", "e=null", "f=x=y"]) == {
        "a": 8, "b": "M*M", "c": True, "d": [1, 2], "e": None, "f": "x=y"}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_overrides(["vocab_size"])


@pytest.mark.parametrize(("overrides", "field"), [
    ({"model_type": "llama"}, "model_type"),
    ({"hybrid_override_pattern": "M*X"}, "hybrid_override_pattern"),
    ({"mlp_hidden_act": "swish"}, "mlp_hidden_act"),
    ({"num_hidden_layers": 5}, "num_hidden_layers"),
    ({"torch_dtype": "int8"}, "torch_dtype"),
])
def test_bad_config_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        build_config("tiny", overrides=overrides)


def test_bad_preset_and_dtype_conflict():
    with pytest.raises(ValueError, match="preset"):
        build_config("huge")
    with pytest.raises(ValueError, match="disagree"):
        build_config("tiny", overrides={"torch_dtype": "float16"}, dtype="bfloat16")


def test_deterministic_given_seed(tmp_path):
    a = make_model(tmp_path / "a", "tiny", mtp_layers=1, seed=3, progress=False)
    b = make_model(tmp_path / "b", "tiny", mtp_layers=1, seed=3, progress=False)
    c = make_model(tmp_path / "c", "tiny", mtp_layers=1, seed=4, progress=False)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


@pytest.mark.parametrize("device", ["tpu", "not a device", "cuda:7" if torch.cuda.is_available() else "cuda"])
def test_a_device_this_machine_lacks_is_refused(tmp_path, device):
    with pytest.raises(ValueError, match="device: expected"):
        make_model(tmp_path / "m", "tiny", device=device, progress=False)
    assert not (tmp_path / "m").exists()  # refused before anything is written


@pytest.mark.gpu
def test_weights_drawn_on_the_gpu_are_deterministic_and_match_the_cpu_draw_in_shape_and_scale(tmp_path):
    a = make_model(tmp_path / "a", "tiny", mtp_layers=1, seed=3, device="cuda", progress=False)
    b = make_model(tmp_path / "b", "tiny", mtp_layers=1, seed=3, device="cuda", progress=False)
    cpu = make_model(tmp_path / "cpu", "tiny", mtp_layers=1, seed=3, progress=False)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    with safe_open(str(a / "model.safetensors"), framework="pt") as fa, \
            safe_open(str(cpu / "model.safetensors"), framework="pt") as fc:
        assert set(fa.keys()) == set(fc.keys())
        for k in fa.keys():  # noqa: SIM118
            x, y = fa.get_tensor(k), fc.get_tensor(k)
            assert x.shape == y.shape and x.dtype == y.dtype, k
            leaf = k.rsplit(".", 1)[-1]
            constant = leaf in ("D", "A_log") or (leaf == "bias" and "conv1d" not in k)  # conv1d.bias is drawn
            if constant or k.endswith("norm.weight") or k.endswith("norm_f.weight"):
                assert torch.equal(x, y), k  # constants
            elif x.numel() >= 1024:  # random draws: the same scale, other values
                assert not torch.equal(x, y), k
                assert abs(x.float().std() / y.float().std() - 1) < 0.1, k


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_dtypes(tmp_path, dtype):
    out = make_model(tmp_path / dtype, "tiny", mtp_layers=1, dtype=dtype,
                     overrides={"hybrid_override_pattern": "M*E"}, progress=False)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == dtype
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("model.embeddings.weight").dtype == getattr(torch, dtype)
        assert f.get_tensor("model.layers.2.mixer.gate.weight").dtype == torch.float32
        assert f.get_tensor("mtp.layers.1.mixer.gate.e_score_correction_bias").dtype == torch.float32
    model = _hf_load(out)
    assert model.dtype == getattr(torch, dtype)


def test_sharded_write_equals_single_file(tmp_path):
    single = make_model(tmp_path / "single", "tiny", mtp_layers=1, progress=False)
    sharded = make_model(tmp_path / "sharded", "tiny", mtp_layers=1, shard_size_bytes=200_000, progress=False)
    files = sorted(p.name for p in sharded.glob("model*.safetensors"))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    with safe_open(str(single / "model.safetensors"), framework="pt") as f:
        ref = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    assert set(index["weight_map"]) == set(ref)
    for k, file in index["weight_map"].items():
        with safe_open(str(sharded / file), framework="pt") as f:
            assert torch.equal(f.get_tensor(k), ref[k]), k
    sd_single, sd_sharded = _hf_load(single).state_dict(), _hf_load(sharded).state_dict()
    assert all(torch.equal(sd_single[k], sd_sharded[k]) for k in sd_single)
    # Rewriting a directory as one file removes the old shards.
    make_model(sharded, "tiny", progress=False)
    assert sorted(p.name for p in sharded.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json",
                                                         "tokenizer_config.json"]


def test_greedy_output_is_not_degenerate(tmp_path):
    model = _hf_load(make_model(tmp_path / "m", "tiny", progress=False))
    prompt = torch.tensor([[11, 300, 7, 42, 99, 5]])
    with torch.no_grad():
        logits = model(prompt).logits[0]  # [T, V]
        out = model.generate(prompt, max_new_tokens=24, do_sample=False)[0, prompt.shape[1]:]
    assert len(set(logits.argmax(-1).tolist())) == prompt.shape[1]
    assert len(set(out.tolist())) >= 8
    assert logits.std() > 1.0


# nvidia/Nemotron-H-8B-Base-8K config.json (HF hub) and Megatron-Bridge `NemotronHModel8BProvider`.
REAL_8B = {
    "vocab_size": 131072, "hidden_size": 4096, "num_hidden_layers": 52,
    "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 21504,
    "mlp_hidden_act": "relu2", "mamba_num_heads": 128, "mamba_head_dim": 64, "ssm_state_size": 128,
    "n_groups": 8, "conv_kernel": 4, "chunk_size": 128, "expand": 2, "use_conv_bias": True, "use_bias": False,
    "mamba_proj_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "layer_norm_epsilon": 1e-5, "max_position_embeddings": 8192, "bos_token_id": 1, "eos_token_id": 2,
    "pad_token_id": 0, "model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"],
}


def test_8b_like_is_the_real_8b_shape():
    d = build_config("8b-like")
    assert {k: d[k] for k in REAL_8B} == REAL_8B
    cfg = ModelConfig.from_hf_dict(d)
    assert (cfg.pattern.count("M"), cfg.pattern.count("-"), cfg.pattern.count("*")) == (24, 24, 4)
    assert cfg.attention_layer_ids == (7, 18, 29, 40)
    assert num_parameters(expected_weight_shapes(cfg)) == pytest.approx(8.1e9, rel=0.01)
    hf = transformers.NemotronHConfig(**d)
    assert hf.num_hidden_layers == 52 and hf.mamba_num_heads * hf.mamba_head_dim == 8192


def test_8b_like_mtp_is_dense():
    cfg = ModelConfig.from_hf_dict(build_config("8b-like", mtp_layers=1))
    assert cfg.mtp_layer_types == ("*", "-")


@pytest.mark.slow
def test_8b_like_writes_and_loads(tmp_path):
    if shutil.disk_usage(tmp_path).free < 20 * 2**30:
        pytest.skip("needs 20 GiB of free disk")
    from baton.engine.loader import load_checkpoint

    out = make_model(tmp_path / "8b", "8b-like", progress=False)
    try:
        assert len(list(out.glob("model-*.safetensors"))) > 1
        cfg, state = load_checkpoint(out)
        assert cfg.torch_dtype == "bfloat16" and state["lm_head.weight"].dtype == torch.bfloat16
        assert {k: tuple(v.shape) for k, v in state.items()} == expected_weight_shapes(cfg)
    finally:
        shutil.rmtree(out)  # 16 GB


def test_cli(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    make_model_cmd.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["make-model", str(tmp_path / "m"), "--preset", "tiny", "--mtp-layers", "1",
                              "--seed", "1", "--dtype", "bfloat16", "--set", "vocab_size=256",
                              "--set", "hybrid_override_pattern=M*M-"])
    assert args.run is make_model_cmd.run
    assert args.run(args) == 0
    printed = capsys.readouterr().out
    assert str(tmp_path / "m") in printed and "parameters" in printed and "MiB" in printed
    cfg = ModelConfig.from_hf_dict(json.loads((tmp_path / "m" / "config.json").read_text()))
    assert dataclasses.astuple(cfg)[:3] == (256, 64, ("M", "*", "M", "-"))
    assert cfg.num_nextn_predict_layers == 1 and cfg.torch_dtype == "bfloat16"
    with pytest.raises(ValueError, match="bogus"):
        make_model_cmd.run(parser.parse_args(["make-model", str(tmp_path / "n"), "--set", "bogus=1"]))


def test_nano_30b_a3b_like_is_the_real_nano_shape():
    d = build_config("nano-30b-a3b-like", mtp_layers=1)
    cfg = ModelConfig.from_hf_dict(d)
    assert (cfg.hidden_size, cfg.num_layers, cfg.vocab_size) == (2688, 52, 131072)
    assert (cfg.pattern.count("M"), cfg.pattern.count("E"), cfg.pattern.count("*")) == (23, 23, 6)
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
            cfg.moe_shared_expert_intermediate_size) == (128, 6, 1856, 3712)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.mamba_num_heads, cfg.mamba_head_dim) == (32, 2, 64, 64)
    assert cfg.mtp_layer_types == ("*", "E")  # the Nemotron 3 MTP block: attention then MoE
    body = expected_weight_shapes(cfg, include_mtp=False)
    assert num_parameters(body) == pytest.approx(31.6e9, rel=0.01)
    transformers.NemotronHConfig(**d)


def test_tiny_moe_runs_moe_layers_and_an_moe_mtp_block(tmp_path):
    out = make_model(tmp_path / "m", "tiny-moe", mtp_layers=1, progress=False, tokenizer=False)
    cfg = ModelConfig.from_hf_dict(json.loads((out / "config.json").read_text()))
    assert "E" in cfg.pattern and "M" in cfg.pattern and "*" in cfg.pattern and cfg.mtp_layer_types == ("*", "E")
    assert _file_shapes(out) == expected_weight_shapes(cfg)
    _hf_load(out)


@pytest.mark.parametrize("quantize", ["fp8", "fp8-block"])
def test_cli_quantize(tmp_path, capsys, quantize):
    parser = argparse.ArgumentParser()
    make_model_cmd.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["make-model", str(tmp_path / "q"), "--preset", "tiny", "--quantize", quantize,
                              "--no-tokenizer"])
    assert args.run(args) == 0
    assert quantize in capsys.readouterr().out
    d = json.loads((tmp_path / "q" / "config.json").read_text())
    assert d["quantization_config"]["quant_method"] == ("modelopt" if quantize == "fp8" else "fp8")
    shapes = _file_shapes(tmp_path / "q")
    scale = "weight_scale" if quantize == "fp8" else "weight_scale_inv"
    assert f"model.layers.0.mixer.in_proj.{scale}" in shapes and "lm_head.weight" in shapes
    assert "model.layers.0.mixer.conv1d.weight" in shapes and "model.layers.0.mixer.conv1d.weight_scale" not in shapes
