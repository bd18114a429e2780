"""Canonical parameter names and shapes of a Qwen3.5 checkpoint's text model.

Canonical names are HF transformers' `Qwen3_5ForCausalLM` ones: `model.embed_tokens.weight`,
`model.layers.{i}.input_layernorm.weight`, `...linear_attn.*` (Gated DeltaNet layers) or `...self_attn.*` (gated
attention), `...post_attention_layernorm.weight`, `...mlp.{gate,up,down}_proj.weight`, `model.norm.weight`,
`lm_head.weight`. A released `Qwen3_5ForConditionalGeneration` checkpoint keeps the text model under
`model.language_model.` (renamed here) beside the vision tower's `model.visual.*` (dropped: Baton serves text).
The MTP drafter (`mtp_num_hidden_layers`, HF ignores it; names as vLLM's `Qwen3_5MultiTokenPredictor` loads them):
`mtp.fc.weight` [hidden, 2 * hidden], `mtp.pre_fc_norm_embedding.weight`, `mtp.pre_fc_norm_hidden.weight`,
`mtp.layers.{i}.*` (full-attention decoder layers, named as `model.layers`), `mtp.norm.weight`. MoE layers (`qwen3_5_moe`, `qwen3_next`) hold
`mlp.gate`, `mlp.experts.gate_up_proj` / `down_proj` (fused, as HF 5.x; per-expert checkpoints are merged),
`mlp.shared_expert.*` and `mlp.shared_expert_gate`; Qwen3-Next's fused GDN projections are split into Qwen3.5's.
An FP8 checkpoint's per-expert scales are merged beside their stacks, each expert's gate and up scales kept apart
(`gate_up_proj_scale` [E, 2], `gate_up_proj_scale_inv` [E, gate's row blocks + up's, column blocks]: the layout
`ops.moe.reference` describes), `down_proj_scale` [E] / `down_proj_scale_inv` as NemotronH's.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping

import torch

from baton.engine.config import ModelConfig
from baton.engine.layer_symbols import ATTENTION, GDN, MLP, MOE
from baton.engine.quant_config import STACK_SCALE
from baton.engine.weights_experts import stack_experts, stack_suffix

logger = logging.getLogger(__name__)

TEXT_PREFIX, CANONICAL_PREFIX = "model.language_model.", "model."
VISION_PREFIX = "model.visual."
_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)"
                         r"\.(?P<leaf>weight|weight_scale|weight_scale_inv)$")


def _layer_shapes(cfg: ModelConfig, prefix: str, mixer: str, mlp: str) -> dict[str, tuple[int, ...]]:
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
    out[f"{prefix}.post_attention_layernorm.weight"] = (h,)
    if mlp == MOE:
        e, i, p = cfg.n_routed_experts, cfg.moe_intermediate_size, f"{prefix}.mlp"
        out[f"{p}.gate.weight"] = (e, h)
        out[f"{p}.experts.gate_up_proj"] = (e, 2 * i, h)
        out[f"{p}.experts.down_proj"] = (e, h, i)
        out.update(_gated_mlp(f"{p}.shared_expert", h, cfg.moe_shared_expert_intermediate_size))
        out[f"{p}.shared_expert_gate.weight"] = (1, h)
    else:
        out.update(_gated_mlp(f"{prefix}.mlp", h, cfg.intermediate_size))
    return out


def _gated_mlp(prefix: str, h: int, i: int) -> dict[str, tuple[int, ...]]:
    return {f"{prefix}.gate_proj.weight": (i, h), f"{prefix}.up_proj.weight": (i, h),
            f"{prefix}.down_proj.weight": (h, i)}


def qwen3_5_weight_shapes(cfg: ModelConfig, include_mtp: bool = True) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape of every tensor of `cfg`'s text model, in HF module order."""
    mixers, mlps = cfg.layer_types[0::2], cfg.layer_types[1::2]
    if len(mixers) != len(mlps) or any(m not in (MLP, MOE) for m in mlps):
        raise ValueError(f"qwen3_5 block pattern: expected (mixer, MLP) pairs, got {cfg.pattern!r}")
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size)}
    for i, (mixer, mlp) in enumerate(zip(mixers, mlps, strict=True)):
        out.update(_layer_shapes(cfg, f"model.layers.{i}", mixer, mlp))
    out["model.norm.weight"] = (cfg.hidden_size,)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    if include_mtp and cfg.num_nextn_predict_layers:
        h = cfg.hidden_size
        out["mtp.fc.weight"] = (h, 2 * h)  # [out, in]: in = [pre_fc_norm_embedding(e); pre_fc_norm_hidden(h)]
        out["mtp.pre_fc_norm_embedding.weight"] = (h,)
        out["mtp.pre_fc_norm_hidden.weight"] = (h,)
        mixer, mlp = cfg.mtp_layer_types
        for i in range(cfg.num_nextn_predict_layers):
            out.update(_layer_shapes(cfg, f"mtp.layers.{i}", mixer, mlp))
        out["mtp.norm.weight"] = (h,)
    return out


def _merge_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert `P.experts.{j}.{gate,up,down}_proj.weight` -> `P.experts.gate_up_proj` [E, 2I, H] (each expert's
    gate rows, then its up rows) and `P.experts.down_proj` [E, H, I], as HF's conversion mapping merges them; FP8
    scales beside them (module docstring)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[str, dict[int, torch.Tensor]]] = {}
    for name, t in state.items():
        m = _PER_EXPERT.match(name)
        if m:
            experts.setdefault((m["prefix"], stack_suffix(m["leaf"])), {}).setdefault(m["proj"], {})[
                int(m["expert"])] = t
        else:
            out[name] = t
    for (prefix, suffix), projs in experts.items():
        n = 1 + max(j for by in projs.values() for j in by)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            missing = [j for j in range(n) if j not in projs.get(proj, {})]
            if missing:
                raise ValueError(f"checkpoint: per-expert weights of '{prefix}': expected {proj}{suffix} of experts "
                                 f"0..{n - 1}, missing {missing[:8]}")
        # a per-tensor scale per segment ([2] per expert); block grids and weights row after row
        join = torch.stack if suffix == STACK_SCALE else torch.cat
        gate_up = {j: join([projs["gate_proj"][j], projs["up_proj"][j]]) for j in range(n)}
        for name, by_index in ((f"{prefix}.gate_up_proj{suffix}", gate_up),
                               (f"{prefix}.down_proj{suffix}", projs["down_proj"])):
            if name in out:
                raise ValueError(f"checkpoint: tensor '{name}' appears both fused and per expert")
            out[name] = stack_experts(name, by_index)
    return out


def _split_interleaved(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Qwen3-Next's `in_proj_qkvz` (per key head: its q, k, then its value heads' v, then their z) and `in_proj_ba`
    (per key head: its value heads' b, then their a) -> Qwen3.5's `in_proj_qkv`, `in_proj_z`, `in_proj_b`,
    `in_proj_a` (HF `Qwen3NextGatedDeltaNet.fix_query_key_value_ordering`)."""
    hk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = cfg.linear_num_value_heads // hk
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.endswith(".in_proj_qkvz.weight"):
            p = name[:-len("in_proj_qkvz.weight")]
            q, k, v, z = t.reshape(hk, 2 * dk + 2 * r * dv, -1).split([dk, dk, r * dv, r * dv], dim=1)
            out[p + "in_proj_qkv.weight"] = torch.cat([x.reshape(-1, t.shape[-1]) for x in (q, k, v)])
            out[p + "in_proj_z.weight"] = z.reshape(-1, t.shape[-1])
        elif name.endswith(".in_proj_ba.weight"):
            p = name[:-len("in_proj_ba.weight")]
            b, a = t.reshape(hk, 2 * r, -1).split([r, r], dim=1)
            out[p + "in_proj_b.weight"] = b.reshape(-1, t.shape[-1])
            out[p + "in_proj_a.weight"] = a.reshape(-1, t.shape[-1])
        else:
            out[name] = t
    return out


def canonicalize_qwen3_5(state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """`model.language_model.X` -> `model.X`; the vision tower's tensors dropped with a log line;
    per-expert weights merged; Qwen3-Next's interleaved GDN projections split."""
    out: dict[str, torch.Tensor] = {}
    dropped = 0
    for name, t in state.items():
        if name.startswith(TEXT_PREFIX):
            name = CANONICAL_PREFIX + name[len(TEXT_PREFIX):]
        if name.startswith(VISION_PREFIX):
            dropped += 1
            continue
        if name in out:
            raise ValueError(f"checkpoint: tensor '{name}' appears twice (with and without 'model.language_model.')")
        out[name] = t
    if dropped:
        logger.info("qwen3_5: not loading %d %s* tensors (the vision tower)", dropped, VISION_PREFIX)
    out = _merge_experts(out)
    return _split_interleaved(out, cfg) if cfg.gdn_interleaved_projections else out
