"""Canonical parameter names and shapes of a Qwen3.5 checkpoint's text model.

Canonical names are HF transformers' `Qwen3_5ForCausalLM` ones: `model.embed_tokens.weight`,
`model.layers.{i}.input_layernorm.weight`, `...linear_attn.*` (Gated DeltaNet layers) or `...self_attn.*` (gated
attention), `...post_attention_layernorm.weight`, `...mlp.{gate,up,down}_proj.weight`, `model.norm.weight`,
`lm_head.weight`. A released `Qwen3_5ForConditionalGeneration` checkpoint keeps the text model under
`model.language_model.` (renamed here) beside the vision tower's `model.visual.*` (dropped: Baton serves text).
Its `mtp.*` tensors are dropped too: this family's MTP is not run.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from baton.engine.config import ModelConfig
from baton.engine.layer_symbols import ATTENTION, GDN, MLP

logger = logging.getLogger(__name__)

TEXT_PREFIX, CANONICAL_PREFIX = "model.language_model.", "model."
DROPPED_PREFIXES = ("model.visual.", "mtp.")


def _layer_shapes(cfg: ModelConfig, prefix: str, mixer: str) -> dict[str, tuple[int, ...]]:
    h = cfg.hidden_size
    out: dict[str, tuple[int, ...]] = {f"{prefix}.input_layernorm.weight": (h,)}
    if mixer == GDN:
        p, hv, k = f"{prefix}.linear_attn", cfg.linear_num_value_heads, cfg.conv_kernel
        out[f"{p}.in_proj_qkv.weight"] = (cfg.gdn_conv_dim, h)
        out[f"{p}.in_proj_z.weight"] = (cfg.gdn_value_dim, h)
        out[f"{p}.in_proj_b.weight"] = (hv, h)
        out[f"{p}.in_proj_a.weight"] = (hv, h)
        out[f"{p}.conv1d.weight"] = (cfg.gdn_conv_dim, 1, k)
        out[f"{p}.dt_bias"] = (hv,)
        out[f"{p}.A_log"] = (hv,)
        out[f"{p}.norm.weight"] = (cfg.linear_value_head_dim,)
        out[f"{p}.out_proj.weight"] = (h, cfg.gdn_value_dim)
    elif mixer == ATTENTION:
        p, d = f"{prefix}.self_attn", cfg.head_dim
        q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
        out[f"{p}.q_proj.weight"] = (2 * q, h)  # per head: its queries, then its output gate
        out[f"{p}.k_proj.weight"] = (kv, h)
        out[f"{p}.v_proj.weight"] = (kv, h)
        out[f"{p}.o_proj.weight"] = (h, q)
        out[f"{p}.q_norm.weight"] = (d,)
        out[f"{p}.k_norm.weight"] = (d,)
    else:
        raise ValueError(f"qwen3_5 layer {prefix}: expected a G or * token mixer, got {mixer!r}")
    i = cfg.intermediate_size
    out[f"{prefix}.post_attention_layernorm.weight"] = (h,)
    out[f"{prefix}.mlp.gate_proj.weight"] = (i, h)
    out[f"{prefix}.mlp.up_proj.weight"] = (i, h)
    out[f"{prefix}.mlp.down_proj.weight"] = (h, i)
    return out


def qwen3_5_weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape of every tensor of `cfg`'s text model, in HF module order."""
    mixers, mlps = cfg.layer_types[0::2], cfg.layer_types[1::2]
    if len(mixers) != len(mlps) or any(m != MLP for m in mlps):
        raise ValueError(f"qwen3_5 block pattern: expected (mixer, MLP) pairs, got {cfg.pattern!r}")
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size)}
    for i, mixer in enumerate(mixers):
        out.update(_layer_shapes(cfg, f"model.layers.{i}", mixer))
    out["model.norm.weight"] = (cfg.hidden_size,)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    return out


def canonicalize_qwen3_5(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`model.language_model.X` -> `model.X`; the vision tower's and MTP's tensors dropped with a log line."""
    out: dict[str, torch.Tensor] = {}
    dropped = {p: 0 for p in DROPPED_PREFIXES}
    for name, t in state.items():
        if name.startswith(TEXT_PREFIX):
            name = CANONICAL_PREFIX + name[len(TEXT_PREFIX):]
        prefix = next((p for p in DROPPED_PREFIXES if name.startswith(p)), None)
        if prefix is not None:
            dropped[prefix] += 1
            continue
        if name in out:
            raise ValueError(f"checkpoint: tensor '{name}' appears twice (with and without 'model.language_model.')")
        out[name] = t
    for prefix, n in dropped.items():
        if n:
            logger.info("qwen3_5: not loading %d %s* tensors (%s)", n, prefix,
                        "the vision tower" if prefix == "model.visual." else "MTP is not run for this family")
    return out
