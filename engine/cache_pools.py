"""The cache pools (KV blocks, and the state pools the recurrent mixer declares), allocated once per engine (and
registered with NIXL once).

All are laid out id-major, so that everything a request owns is as contiguous as it can be:

- KV block pool: [num_blocks, L_attn + L_mtp, 2, block_size, Hkv, D]. A block holds the K and V of every
  attention layer, so a run of consecutive block ids is ONE contiguous region for all layers (one
  transfer descriptor, not one per layer). With speculative decoding the MTP drafter's attention layers
  (L_mtp) sit after the target's in the same blocks: its KV travels with the target's (R8). Its dtype is the
  model's, or float8_e4m3fn with `--kv-cache-dtype fp8` (`kv_cache_dtype.py`: half the bytes a block, so twice
  the blocks for the same budget).
- State pools: one per state tensor the model's recurrent mixer declares (`state_spec.StateSpec`), each
  [slots, L_mixer, *shape] (for Mamba2: conv [.., conv_dim, K-1] and ssm [.., H, P, N]): one slot's state of
  every mixer layer is one contiguous region per declared tensor. A request owns one slot.
- Verify inputs (only while verifying drafts): per slot and mixer layer, the declared inputs of the slot's
  last 1+K verified positions, [slots, L_mixer, 1+K, *shape], replayed into the state by the next step once
  the accepted count is known (R3/R4; `ops/spec_verify.py`). They never travel: a transferred request has none pending.

- The sampler's penalty tables (`penalty_counts`: a row per slot) are not pools, but the plan sets their bytes aside
  on an engine that samples (`penalty_bytes`), so that they fit when the first penalised request comes.

- Prefix checkpoints (with prefix caching, `prefix_cache.py`): per declared state, [checkpoints, L_mixer, *shape]:
  copies of a request's state slot at block boundaries of its prompt. They never travel.

Each pool has one spare entry past the plan's: a scratch KV block and a scratch state slot that no request
ever owns, where the padding rows of a CUDA-graph decode step write (`cuda_graphs.py`).

Layers see strided per-layer views (`kv[:, l]`, `states[name][:, l]`); the operators index them by block or slot.
`plan_cache` sizes the pools from a memory budget; the scheduler only ever sees the resulting counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from baton.engine.config import ATTENTION, ModelConfig
from baton.engine.engine_config import EngineConfig
from baton.engine.memory_budget import CPU_CACHE_MEMORY_BYTES, CPU_MAX_NUM_SEQS
from baton.engine.penalty_counts import table_bytes
from baton.engine.state_spec import StateSpec


@dataclass(frozen=True)
class CachePlan:
    num_blocks: int
    num_slots: int
    block_bytes: int  # one block across all attention layers (K and V), the drafter's included
    slot_bytes: int   # one state slot across all mixer layers (every declared state and verify input)
    state: StateSpec  # what the model's recurrent mixer keeps per slot
    num_mtp_kv_layers: int = 0  # the drafter's attention layers, after the target's in every block
    verify_len: int = 0  # positions of verify inputs per slot (1+K while verifying drafts)
    num_checkpoints: int = 0  # prefix checkpoint slots (0: no prefix cache)
    checkpoint_bytes: int = 0  # one checkpoint across all mixer layers (every declared state)
    penalty_bytes: int = 0  # one slot's penalty tables (0: a prefill-only engine, which never samples)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def plan_cache(cfg: ModelConfig, state: StateSpec, ecfg: EngineConfig, dtype: torch.dtype,
               state_dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> CachePlan:
    """The pools' sizes for `ecfg` and the mixer's `state` (the model class's `state_spec`); sizes it leaves to the engine (None) take the CPU defaults (an engine on CUDA
    decides them first, `LLMEngine`). `kv_dtype`: the KV pool's (None: `dtype`)."""
    num_slots = ecfg.max_num_seqs or CPU_MAX_NUM_SEQS
    cache_memory_bytes = ecfg.cache_memory_bytes or CPU_CACHE_MEMORY_BYTES
    n_mtp = mtp_kv_layers(cfg) if ecfg.num_speculative_tokens else 0
    n_attn = len(cfg.attention_layer_ids) + n_mtp
    block_bytes = n_attn * 2 * ecfg.block_size * cfg.num_key_value_heads * cfg.head_dim * _itemsize(kv_dtype or dtype)
    slot_bytes = state.slot_bytes(dtype, state_dtype, ecfg.verify_len)
    checkpoint_bytes = state.slot_bytes(dtype, state_dtype, 0)
    penalty_bytes = 0 if ecfg.prefill_only else table_bytes(cfg.vocab_size)
    num_checkpoints = (ecfg.prefix_checkpoint_slots or num_slots) if ecfg.enable_prefix_caching else 0
    if ecfg.num_kv_blocks is not None:
        num_blocks = ecfg.num_kv_blocks
    elif block_bytes == 0:
        # A model without attention layers still needs block ids for bookkeeping; they cost nothing.
        num_blocks = max(1, -(-num_slots * (ecfg.max_model_len or cfg.max_position_embeddings)
                              // ecfg.block_size))
    else:
        # The budget holds the scratch block and slot, the prefix checkpoints and the penalty tables, too.
        per_slot = slot_bytes + penalty_bytes
        left = cache_memory_bytes - (num_slots + 1) * per_slot - num_checkpoints * checkpoint_bytes
        num_blocks = left // block_bytes - 1
        if num_blocks < 1:
            need = (num_slots + 1) * per_slot + num_checkpoints * checkpoint_bytes + 2 * block_bytes
            raise ValueError(
                f"engine field 'cache_memory_bytes': expected at least {need} bytes ({num_slots} state slots of "
                f"{slot_bytes} B and penalty tables of {penalty_bytes} B, {num_checkpoints} prefix checkpoints of "
                f"{checkpoint_bytes} B + one KV block of {block_bytes} B, and one scratch slot and block), got "
                f"{cache_memory_bytes}")
    return CachePlan(num_blocks=num_blocks, num_slots=num_slots, block_bytes=block_bytes, slot_bytes=slot_bytes,
                     state=state, num_mtp_kv_layers=n_mtp, verify_len=ecfg.verify_len,
                     num_checkpoints=num_checkpoints, checkpoint_bytes=checkpoint_bytes, penalty_bytes=penalty_bytes)


def mtp_kv_layers(cfg: ModelConfig) -> int:
    """Attention layers of the MTP drafter (all its steps' layers), each with a KV pool layer of its own."""
    return cfg.num_nextn_predict_layers * sum(t == ATTENTION for t in cfg.mtp_layer_types)


class CachePools:
    def __init__(self, cfg: ModelConfig, plan: CachePlan, block_size: int, dtype: torch.dtype,
                 state_dtype: torch.dtype, device: torch.device | str, kv_dtype: torch.dtype | None = None) -> None:
        """`kv_dtype`: the KV pool's (None: `dtype`)."""
        self.plan = plan
        self.num_target_kv_layers = len(cfg.attention_layer_ids)
        n_attn, spec = self.num_target_kv_layers + plan.num_mtp_kv_layers, plan.state
        # The scratch block and slot: one past the plan's (never allocated by the scheduler).
        self.scratch_block, self.scratch_slot = plan.num_blocks, plan.num_slots
        self.kv = torch.zeros(plan.num_blocks + 1, n_attn, 2, block_size, cfg.num_key_value_heads, cfg.head_dim,
                              dtype=kv_dtype or dtype, device=device)
        S, L = plan.num_slots + 1, spec.num_layers
        # Declared name -> [slots, L_mixer, *shape], in declared order.
        self.states = {t.name: torch.zeros(S, L, *t.shape, dtype=t.torch_dtype(dtype, state_dtype), device=device)
                       for t in spec.states}
        # Declared name -> [checkpoints, L_mixer, *shape].
        self.checkpoints = {t.name: torch.zeros(plan.num_checkpoints, L, *t.shape,
                                                dtype=t.torch_dtype(dtype, state_dtype), device=device)
                            for t in spec.states}
        # Declared name -> [slots, L_mixer, 1+K, *shape].
        self.verify = {t.name: torch.zeros(S, L, plan.verify_len, *t.shape, dtype=t.torch_dtype(dtype, state_dtype),
                                           device=device) for t in spec.verify_inputs}

    def by_name(self) -> dict[str, torch.Tensor]:
        """The pools that travel, as `baton.transfer` registers them: "kv", then every declared state."""
        return {"kv": self.kv, **self.states}

    def state_bytes(self) -> int:
        """The state pools' and verify inputs' bytes."""
        return sum(t.numel() * t.element_size() for t in (*self.states.values(), *self.verify.values()))

    def checkpoint_pool_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.checkpoints.values())

    def copy_slots(self, pairs: tuple[tuple[int, int], ...], to_checkpoints: bool) -> None:
        """Copy every declared state of each (source, destination) pair on the device: state slot -> checkpoint slot
        (`to_checkpoints`), else checkpoint slot -> state slot."""
        for name, states in self.states.items():
            src, dst = (states, self.checkpoints[name]) if to_checkpoints else (self.checkpoints[name], states)
            for a, b in pairs:
                dst[b].copy_(src[a])

    def fork_slots(self, pairs: list[tuple[int, int]]) -> None:
        """Copy every declared state of each (source, destination) pair of state slots on the device."""
        for states in self.states.values():
            for a, b in pairs:
                states[b].copy_(states[a])

    # Per-layer strided views: [num_blocks, 2, block_size, Hkv, D]; per mixer layer its states [slots, *shape].
    def kv_layers(self) -> list[torch.Tensor]:
        return list(self.kv.unbind(1))[:self.num_target_kv_layers]

    def mtp_kv_layers(self) -> list[torch.Tensor]:
        """The drafter's KV pool layers (same blocks as the target's, R8)."""
        return list(self.kv.unbind(1))[self.num_target_kv_layers:]

    def state_layers(self) -> list[tuple[torch.Tensor, ...]]:
        """Per mixer layer: its declared states in declared order, each [slots, *shape]."""
        return list(zip(*(t.unbind(1) for t in self.states.values()), strict=True))

    def verify_layers(self) -> list[tuple[torch.Tensor, ...]]:
        """Per mixer layer: its declared verify inputs in declared order, each [slots, 1+K, *shape]; empty without
        speculative decoding."""
        if not self.plan.verify_len:
            return []
        return list(zip(*(t.unbind(1) for t in self.verify.values()), strict=True))
