"""How a registered cache pool is laid out, in bytes: what the peer needs to address its items.

Pools are id-major (see `baton.engine.cache_pools`): item i (a KV block, or a state slot) of every layer
is one contiguous region at `base_addr + i * item_bytes`.
"""

from __future__ import annotations

import msgspec
import torch


class RegionLayout(msgspec.Struct, frozen=True):
    name: str                    # "kv" or a state pool's declared name
    base_addr: int
    num_items: int               # blocks or slots
    item_bytes: int              # one block / one slot, all layers
    item_shape: tuple[int, ...]  # e.g. [L_attn, 2, block_size, Hkv, D]
    dtype: str
    mem_type: str                # "DRAM" | "VRAM"
    dev_id: int

    @property
    def layer_stride_bytes(self) -> int:
        return self.item_bytes // self.item_shape[0] if self.item_shape and self.item_shape[0] else 0

    def item_addr(self, item: int) -> int:
        if not 0 <= item < self.num_items:
            raise ValueError(f"{self.name} item: expected an id in [0, {self.num_items}), got {item}")
        return self.base_addr + item * self.item_bytes

    @classmethod
    def of(cls, name: str, pool: torch.Tensor) -> RegionLayout:
        """Describe an id-major pool tensor [num_items, ...]; it must be contiguous."""
        if not pool.is_contiguous():
            raise ValueError(f"{name} pool: expected a contiguous tensor, got strides {pool.stride()}")
        num_items = pool.shape[0]
        return cls(
            name=name,
            base_addr=pool.data_ptr(),
            num_items=num_items,
            item_bytes=pool[0].numel() * pool.element_size() if num_items else 0,
            item_shape=tuple(pool.shape[1:]),
            dtype=str(pool.dtype).removeprefix("torch."),
            mem_type="VRAM" if pool.is_cuda else "DRAM",
            dev_id=(pool.device.index or 0) if pool.is_cuda else 0,
        )
