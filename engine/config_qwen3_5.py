"""Qwen3.5's text config (HF `Qwen3_5TextConfig`, `Qwen3_5MoeTextConfig`, `Qwen3NextConfig`) -> ModelConfig's fields.

A released Qwen3.5 checkpoint is `Qwen3_5ForConditionalGeneration` (`model_type` "qwen3_5"), its text model's
fields under `text_config` and a vision tower's under `vision_config`; `Qwen3_5ForCausalLM` writes the text
config alone ("qwen3_5_text"); the MoE models likewise ("qwen3_5_moe", "qwen3_5_moe_text"), and Qwen3-Next
("qwen3_next") is flat. Each decoder layer becomes two blocks: its token mixer (G for `linear_attention`, * for
`full_attention`) and its MLP (- gated MLP, E sparse MoE block: every layer of Qwen3.5-MoE, Qwen3-Next's by
`decoder_sparse_step` and `mlp_only_layers`). The vision tower is not run: Baton
serves text (the loader drops its weights with a log line).
"""

from __future__ import annotations

import logging
from typing import Any

from baton.engine.layer_symbols import ATTENTION, GDN, MLP, MOE, QWEN3_5, config_error

logger = logging.getLogger(__name__)

QWEN3_5_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
# The outer (ConditionalGeneration) model types whose text model's fields sit under `text_config`.
_NESTED = ("qwen3_5", "qwen3_5_moe")
_LAYER_TYPES = {"linear_attention": GDN, "full_attention": ATTENTION}
GDN_CHUNK_SIZE = 64  # the chunk of the chunked gated delta rule (HF's and flash-linear-attention's)


def _text_config(d: dict) -> dict:
    if d.get("model_type") in _NESTED and "text_config" in d:
        text = d["text_config"]
        if not isinstance(text, dict):
            raise config_error("text_config", "a JSON object", text)
        if d.get("vision_config") is not None:
            logger.info("%s: serving the text model; the vision tower (vision_config) is not run", d["model_type"])
        # Fields the outer config sets for the whole model (HF reads them there).
        outer = {k: d[k] for k in ("tie_word_embeddings", "eos_token_id", "bos_token_id", "pad_token_id")
                 if k in d and k not in text}
        return {**outer, **text}
    return d


def _rope(t: dict, head_dim: int) -> tuple[float, int]:
    """(rope_theta, rotary_dim) from `rope_parameters` (or the older top-level fields)."""
    rope = t.get("rope_parameters") or t.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise config_error("rope_parameters", "a JSON object", rope)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise config_error("rope_parameters.rope_type", "'default' (other RoPE scalings are not supported)", rope_type)
    theta = rope.get("rope_theta", t.get("rope_theta", 10000.0))
    factor = rope.get("partial_rotary_factor", t.get("partial_rotary_factor", 0.25))
    if not isinstance(factor, int | float) or not 0 < factor <= 1:
        raise config_error("partial_rotary_factor", "a number in (0, 1]", factor)
    return float(theta), int(head_dim * factor)


def _sparse(t: dict, model_type: str, layer: int) -> bool:
    """Whether decoder layer `layer`'s MLP is the sparse MoE block (HF's rule per model type)."""
    if model_type in ("qwen3_5_moe", "qwen3_5_moe_text"):
        return True
    if model_type != "qwen3_next":
        return False
    only = t.get("mlp_only_layers") or []
    step = t.get("decoder_sparse_step", 1) or 1
    return layer not in only and t.get("num_experts", 512) > 0 and (layer + 1) % step == 0


def qwen3_5_fields(d: dict) -> dict[str, Any]:
    """ModelConfig's keyword arguments for a Qwen3.5 config dict `d`."""
    t = _text_config(d)

    def get(name: str, default: Any) -> Any:
        v = t.get(name, default)
        return default if v is None else v

    num_layers = get("num_hidden_layers", 32)
    types = t.get("layer_types")
    if types is None:
        interval = get("full_attention_interval", 4)
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    if not isinstance(types, list | tuple) or len(types) != num_layers:
        raise config_error("layer_types", f"a list of num_hidden_layers={num_layers} layer types", types)
    model_type = t.get("model_type", d.get("model_type"))
    blocks: list[str] = []
    for i, kind in enumerate(types):
        if kind not in _LAYER_TYPES:
            raise config_error("layer_types", "entries among 'linear_attention', 'full_attention'", kind)
        blocks += [_LAYER_TYPES[kind], MOE if _sparse(t, model_type, i) else MLP]
    for name, ok in (("hidden_act", "silu"),):
        if get(name, ok) != ok:
            raise config_error(name, repr(ok), t[name])
    if t.get("attention_bias"):
        raise config_error("attention_bias", "false (attention biases are not supported)", t["attention_bias"])
    if t.get("use_sliding_window") or t.get("sliding_window") is not None:
        raise config_error("sliding_window", "null (sliding-window attention is not supported)",
                           t.get("sliding_window", t.get("use_sliding_window")))
    num_heads = get("num_attention_heads", 16)
    head_dim = get("head_dim", get("hidden_size", 4096) // num_heads)
    theta, rotary_dim = _rope(t, head_dim)
    eos = t.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (eos,))
    mtp_layers = get("mtp_num_hidden_layers", 0)
    if not isinstance(mtp_layers, int) or isinstance(mtp_layers, bool) or mtp_layers < 0:
        raise config_error("mtp_num_hidden_layers", "an integer >= 0", mtp_layers)
    # An MTP layer is a full-attention decoder layer with the model's kind of MLP; draft step k runs layer
    # k % mtp_num_hidden_layers (as vLLM's `spec_step_idx % num_mtp_layers`).
    mtp_mlp = MOE if model_type in ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next") else MLP
    return dict(
        family=QWEN3_5,
        vocab_size=get("vocab_size", 248320),
        hidden_size=get("hidden_size", 4096),
        layer_types=tuple(blocks),
        num_attention_heads=num_heads,
        num_key_value_heads=get("num_key_value_heads", 4),
        head_dim=head_dim,
        intermediate_size=get("intermediate_size", 12288),
        mlp_hidden_act="silu",
        mlp_gated=True,
        conv_kernel=get("linear_conv_kernel_dim", 4),
        chunk_size=GDN_CHUNK_SIZE,
        use_conv_bias=False,
        linear_num_key_heads=get("linear_num_key_heads", 16),
        linear_num_value_heads=get("linear_num_value_heads", 32),
        linear_key_head_dim=get("linear_key_head_dim", 128),
        linear_value_head_dim=get("linear_value_head_dim", 128),
        rope_theta=theta,
        rotary_dim=rotary_dim,
        qk_norm=True,
        attn_output_gate=True,
        norm_zero_centered=True,
        layer_norm_epsilon=float(get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        eos_token_ids=eos_ids,
        bos_token_id=t.get("bos_token_id"),
        pad_token_id=t.get("pad_token_id"),
        max_position_embeddings=get("max_position_embeddings", 32768),
        torch_dtype=t.get("torch_dtype", t.get("dtype", d.get("torch_dtype", d.get("dtype")))) or "float32",
        mamba_ssm_cache_dtype=get("mamba_ssm_dtype", "float32"),
        n_routed_experts=get("num_experts", 512),
        num_experts_per_tok=get("num_experts_per_tok", 10),
        moe_intermediate_size=get("moe_intermediate_size", 512),
        moe_shared_expert_intermediate_size=get("shared_expert_intermediate_size", 512),
        norm_topk_prob=bool(get("norm_topk_prob", True)),
        gdn_interleaved_projections=model_type == "qwen3_next",
        num_nextn_predict_layers=mtp_layers,
        mtp_layer_types=(ATTENTION, mtp_mlp),
        raw=d,
    )
