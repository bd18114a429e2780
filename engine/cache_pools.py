"""The two cache pools, allocated once per engine (and, later, registered with NIXL once).

Both are laid out id-major, so that everything a request owns is as contiguous as it can be:

- KV block pool: [num_blocks, L_attn + L_mtp, 2, block_size, Hkv, D]. A block holds the K and V of every
  attention layer, so a run of consecutive block ids is ONE contiguous region for all layers (one
  transfer descriptor, not one per layer). With speculative decoding the MTP drafter's attention layers
  (L_mtp) sit after the target's in the same blocks: its KV travels with the target's (R8).
- State pools: conv [slots, L_mamba, conv_dim, K-1] and SSM [slots, L_mamba, H, P, N]: one slot's
  state of every Mamba layer is one contiguous region per kind. A request owns a group of
  `slots_per_request` consecutive slots (1+K while verifying drafts, R4): group g = slots g*(1+K) ...

Layers see strided per-layer views (`kv[:, l]`, `ssm[:, l]`); the operators index them by block or slot.
`plan_cache` sizes both pools from a memory budget; the scheduler only ever sees the resulting counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from baton.engine.config import ATTENTION, ModelConfig
from baton.engine.engine_config import EngineConfig


@dataclass(frozen=True)
class CachePlan:
    num_blocks: int
    num_slots: int
    block_bytes: int  # one block across all attention layers (K and V), the drafter's included
    slot_bytes: int   # one state slot across all Mamba layers (conv + SSM)
    num_mtp_kv_layers: int = 0  # the drafter's attention layers, after the target's in every block
    slots_per_request: int = 1  # a request's slot group: 1+K while verifying drafts

    @property
    def num_groups(self) -> int:
        """Slot groups = requests that can hold a state at once."""
        return self.num_slots // self.slots_per_request


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def plan_cache(cfg: ModelConfig, ecfg: EngineConfig, dtype: torch.dtype, ssm_dtype: torch.dtype) -> CachePlan:
    n_mtp = mtp_kv_layers(cfg) if ecfg.num_speculative_tokens else 0
    n_attn, n_mamba = len(cfg.attention_layer_ids) + n_mtp, len(cfg.mamba_layer_ids)
    block_bytes = n_attn * 2 * ecfg.block_size * cfg.num_key_value_heads * cfg.head_dim * _itemsize(dtype)
    conv = cfg.conv_dim * (cfg.conv_kernel - 1) * _itemsize(dtype)
    ssm = cfg.mamba_num_heads * cfg.mamba_head_dim * cfg.ssm_state_size * _itemsize(ssm_dtype)
    slot_bytes = n_mamba * (conv + ssm)
    num_slots = ecfg.max_num_seqs * ecfg.slots_per_request
    if ecfg.num_kv_blocks is not None:
        num_blocks = ecfg.num_kv_blocks
    elif block_bytes == 0:
        # A model without attention layers still needs block ids for bookkeeping; they cost nothing.
        num_blocks = max(1, -(-ecfg.max_num_seqs * (ecfg.max_model_len or cfg.max_position_embeddings)
                              // ecfg.block_size))
    else:
        left = ecfg.cache_memory_bytes - num_slots * slot_bytes
        num_blocks = left // block_bytes
        if num_blocks < 1:
            raise ValueError(
                f"engine field 'cache_memory_bytes': expected at least {num_slots * slot_bytes + block_bytes} "
                f"bytes ({num_slots} state slots of {slot_bytes} B + one KV block of {block_bytes} B), "
                f"got {ecfg.cache_memory_bytes}")
    return CachePlan(num_blocks=num_blocks, num_slots=num_slots, block_bytes=block_bytes, slot_bytes=slot_bytes,
                     num_mtp_kv_layers=n_mtp, slots_per_request=ecfg.slots_per_request)


def mtp_kv_layers(cfg: ModelConfig) -> int:
    """Attention layers of the MTP drafter (all its steps' layers), each with a KV pool layer of its own."""
    return cfg.num_nextn_predict_layers * sum(t == ATTENTION for t in cfg.mtp_layer_types)


class CachePools:
    def __init__(self, cfg: ModelConfig, plan: CachePlan, block_size: int, dtype: torch.dtype,
                 ssm_dtype: torch.dtype, device: torch.device | str) -> None:
        self.plan = plan
        self.num_target_kv_layers = len(cfg.attention_layer_ids)
        n_attn, n_mamba = self.num_target_kv_layers + plan.num_mtp_kv_layers, len(cfg.mamba_layer_ids)
        self.kv = torch.zeros(plan.num_blocks, n_attn, 2, block_size, cfg.num_key_value_heads, cfg.head_dim,
                              dtype=dtype, device=device)
        self.conv = torch.zeros(plan.num_slots, n_mamba, cfg.conv_dim, cfg.conv_kernel - 1,
                                dtype=dtype, device=device)
        self.ssm = torch.zeros(plan.num_slots, n_mamba, cfg.mamba_num_heads, cfg.mamba_head_dim,
                               cfg.ssm_state_size, dtype=ssm_dtype, device=device)

    def by_name(self) -> dict[str, torch.Tensor]:
        """The three pools as `baton.transfer` registers them."""
        return {"kv": self.kv, "conv": self.conv, "ssm": self.ssm}

    # Per-layer strided views: [num_blocks, 2, block_size, Hkv, D], [slots, C, K-1], [slots, H, P, N].
    def kv_layers(self) -> list[torch.Tensor]:
        return list(self.kv.unbind(1))[:self.num_target_kv_layers]

    def mtp_kv_layers(self) -> list[torch.Tensor]:
        """The drafter's KV pool layers (same blocks as the target's, R8)."""
        return list(self.kv.unbind(1))[self.num_target_kv_layers:]

    def conv_layers(self) -> list[torch.Tensor]:
        return list(self.conv.unbind(1))

    def ssm_layers(self) -> list[torch.Tensor]:
        return list(self.ssm.unbind(1))
