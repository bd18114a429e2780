"""A rank's model config: the shapes of its shard of every layer, or a ValueError naming the field that cannot be
split.

What is split across `tp` ranks (each rank's part contiguous, in rank order): attention query heads and KV heads
(KV heads replicated, each rank holding the one its query heads read, when there are fewer than ranks), Mamba2
heads and groups (its conv channels and gated-norm channels follow), Gated DeltaNet key and value heads, the MLP's
and the MoE experts' and shared experts' intermediate channels. The vocabulary is split by `vocab` (the config
keeps the full `vocab_size`, which the logits have after their gather). Norms, routers and the MTP fusion
projection are replicated. FP8 weights split as their 16-bit twins (`shard_weights`: their scales follow).

Invariant: `shard_config(cfg, 1)` is `cfg`.
"""

from __future__ import annotations

import dataclasses

from baton.engine.config import ModelConfig
from baton.engine.layer_symbols import ATTENTION, GDN, MAMBA, MLP, MOE


def _all_layer_types(cfg: ModelConfig) -> set[str]:
    return set(cfg.layer_types) | (set(cfg.mtp_layer_types) if cfg.num_nextn_predict_layers else set())


def _split(cfg: ModelConfig, name: str, tp: int) -> int:
    v = getattr(cfg, name)
    if v % tp:
        raise ValueError(f"config field '{name}': expected a multiple of tensor_parallel_size={tp}, got {v}")
    return v // tp


def local_kv_heads(num_kv_heads: int, tp: int) -> int:
    """KV heads per rank: a share of them, or one (replicated) where there are fewer than ranks."""
    return num_kv_heads // tp if num_kv_heads >= tp else 1


def shard_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    if tp == 1:
        return cfg
    kinds = _all_layer_types(cfg)
    fields: dict[str, int] = {}
    if ATTENTION in kinds:
        fields["num_attention_heads"] = _split(cfg, "num_attention_heads", tp)
        kv = cfg.num_key_value_heads
        if kv >= tp and kv % tp or kv < tp and tp % kv:
            raise ValueError(f"config field 'num_key_value_heads': expected a multiple or a divisor of "
                             f"tensor_parallel_size={tp}, got {kv}")
        fields["num_key_value_heads"] = local_kv_heads(kv, tp)
    if MAMBA in kinds:
        fields["mamba_num_heads"] = _split(cfg, "mamba_num_heads", tp)
        fields["n_groups"] = _split(cfg, "n_groups", tp)
    if GDN in kinds:
        fields["linear_num_key_heads"] = _split(cfg, "linear_num_key_heads", tp)
        fields["linear_num_value_heads"] = _split(cfg, "linear_num_value_heads", tp)
    if MLP in kinds:
        fields["intermediate_size"] = _split(cfg, "intermediate_size", tp)
    if MOE in kinds:
        fields["moe_intermediate_size"] = _split(cfg, "moe_intermediate_size", tp)
        fields["moe_shared_expert_intermediate_size"] = _split(cfg, "moe_shared_expert_intermediate_size", tp)
    return dataclasses.replace(cfg, **fields)
