"""Qwen3.5 checkpoints load from both released layouts, and configs the engine cannot run are refused naming the field.

`Qwen3_5ForConditionalGeneration` (how Qwen3.5 is released) nests the text config under `text_config` and keeps the
text weights under `model.language_model.` beside the vision tower's `model.visual.*`: it loads to exactly what the
`Qwen3_5ForCausalLM` layout loads to, the vision tower skipped with a log line.
"""

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from baton.engine.config import ModelConfig
from baton.engine.engine_config import EngineConfig
from baton.engine.llm_engine import LLMEngine
from baton.engine.loader import load_checkpoint
from baton.engine.make_model import build_config, make_model
from baton.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def causal_lm(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen") / "causal"
    make_model(out, preset="qwen3.5-tiny", mtp_layers=1, seed=3, progress=False, tokenizer=False)
    return out


def _as_conditional_generation(src, dst) -> None:
    """Rewrite a Qwen3_5ForCausalLM checkpoint in the released Qwen3_5ForConditionalGeneration layout."""
    dst.mkdir()
    text = json.loads((src / "config.json").read_text())
    text["model_type"] = "qwen3_5_text"
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text,
              "vision_config": {"depth": 2, "hidden_size": 16}, "image_token_id": 248056,
              "tie_word_embeddings": text.pop("tie_word_embeddings")}
    (dst / "config.json").write_text(json.dumps(config))
    state = load_file(str(src / "model.safetensors"))
    renamed = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in state.items()}
    renamed["model.visual.patch_embed.proj.weight"] = torch.zeros(16, 3, 2, 16, 16)
    renamed["model.visual.blocks.0.norm1.weight"] = torch.ones(16)
    half = len(renamed) // 2  # sharded, as released checkpoints are
    names = sorted(renamed)
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for file, part in shards.items():
        save_file({n: renamed[n] for n in part}, str(dst / file))
    index = {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))


def test_the_released_layout_loads_as_the_causal_lm_layout(causal_lm, tmp_path, caplog):
    dst = tmp_path / "released"
    _as_conditional_generation(causal_lm, dst)
    with caplog.at_level(logging.INFO):
        cfg_b, weights_b = load_checkpoint(dst)
    cfg_a, weights_a = load_checkpoint(causal_lm)
    assert cfg_b == cfg_a and cfg_b.family == "qwen3_5" and cfg_b.pattern == "G-G-G-*-"
    assert sorted(weights_b) == sorted(weights_a)
    for name, t in weights_a.items():
        assert torch.equal(weights_b[name], t), name
    logs = caplog.text
    assert "vision tower" in logs and "model.visual.*" in logs
    assert cfg_b.num_nextn_predict_layers == 1 and "mtp.fc.weight" in weights_b  # the MTP stays at the top level
    engine = LLMEngine(cfg_b, weights_b, EngineConfig(max_num_seqs=2, max_num_batched_tokens=32, block_size=8,
                                                      num_speculative_tokens=2))
    assert len(engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids) == 4


REFUSED = [
    ({"sliding_window": 4096}, "sliding_window"),
    ({"use_sliding_window": True}, "sliding_window"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_parameters.rope_type"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.0}}, "partial_rotary_factor"),
    ({"layer_types": ["linear_attention", "moe", "linear_attention", "full_attention"]}, "layer_types"),
    ({"layer_types": ["linear_attention", "full_attention"]}, "layer_types"),
    ({"linear_num_key_heads": 3}, "linear_num_key_heads"),
    ({"model_type": "jamba"}, "model_type"),
]


@pytest.mark.parametrize(("override", "field"), REFUSED, ids=[f for _, f in REFUSED])
def test_a_config_the_engine_cannot_run_is_refused_naming_the_field(override, field):
    d = {**build_config("qwen3.5-tiny"), **override}
    with pytest.raises(ValueError, match=f"'{field}'"):
        ModelConfig.from_hf_dict(d)


def test_a_nested_text_config_that_is_not_an_object_is_refused():
    with pytest.raises(ValueError, match="'text_config'"):
        ModelConfig.from_hf_dict({"model_type": "qwen3_5", "text_config": [1, 2]})


def test_speculative_decoding_is_refused_without_mtp_layers(tmp_path):
    make_model(tmp_path, preset="qwen3.5-tiny", progress=False, tokenizer=False)
    cfg, weights = load_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLMEngine(cfg, weights, EngineConfig(num_speculative_tokens=1, max_num_seqs=2))


def test_make_model_refuses_disagreeing_mtp_layers_and_unknown_keys_for_qwen_presets():
    with pytest.raises(ValueError, match="disagree"):
        build_config("qwen3.5-tiny", mtp_layers=1, overrides={"mtp_num_hidden_layers": 2})
    with pytest.raises(ValueError, match="'mtp_num_hidden_layers'"):
        ModelConfig.from_hf_dict({**build_config("qwen3.5-tiny"), "mtp_num_hidden_layers": -1})
    with pytest.raises(ValueError, match="'hybrid_override_pattern'"):
        build_config("qwen3.5-tiny", overrides={"hybrid_override_pattern": "M*"})


def test_the_moe_model_types_give_their_sparse_layers():
    text = {"model_type": "qwen3_5_moe_text", "num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2}
    released = ModelConfig.from_hf_dict({"model_type": "qwen3_5_moe", "text_config": text, "vision_config": {}})
    assert released == ModelConfig.from_hf_dict(text)
    assert released.pattern == "GEGEGE*E" and released.n_routed_experts == 8 and not released.gdn_interleaved_projections
    nxt = ModelConfig.from_hf_dict({"model_type": "qwen3_next", "num_hidden_layers": 8, "decoder_sparse_step": 2,
                                    "mlp_only_layers": [5]})
    assert nxt.pattern == "G-GEG-*EG-G-G-*E" and nxt.gdn_interleaved_projections


def test_every_tensor_of_the_loaded_model_and_drafter_lies_on_the_engine_device(causal_lm):
    """The model is built on `meta` and its weights assigned at load: a buffer computed at construction (RoPE's
    inverse frequencies) must follow the weights to the device, or the first step on a GPU mixes devices."""
    from baton.engine.model_family import model_class, mtp_class
    from baton.engine.ops.kernels import resolve_kernels

    cfg, weights = load_checkpoint(causal_lm)
    kernels = resolve_kernels("torch", "meta")
    for cls in (model_class(cfg), mtp_class(cfg)):
        module = cls.from_state_dict(cfg, weights, "meta", torch.float32, kernels)
        placed = {name: t.device.type for name, t in [*module.named_parameters(), *module.named_buffers()]}
        assert placed and set(placed.values()) == {"meta"}, {n: d for n, d in placed.items() if d != "meta"}
