"""What a recurrent mixer keeps per request: the declaration that the state pools, transfer and spec replay read.

Invariants: every tensor is per state slot and per layer of the mixer (the pools add [slots, L] in front); the
`states` travel with a request (transfer), in declared order; the `verify_inputs` are per verified position as
well (the pools add [slots, L, 1+K] in front) and never travel. Names are unique within each tuple, and no state
is named "kv" (the attention pool's name).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MODEL_DTYPE = "model"  # the engine's activation dtype
STATE_DTYPE = "state"  # the engine's recurrent-state dtype (a model's ssm cache dtype, often float32)


@dataclass(frozen=True)
class StateTensor:
    name: str
    shape: tuple[int, ...]
    dtype: str = MODEL_DTYPE  # MODEL_DTYPE or STATE_DTYPE
    # How tensor parallelism splits dim 0: its parts in order (this rank's sizes), each part split evenly over the
    # ranks, every rank holding its share of each part in rank order (`parallel.shard_weights`). Empty: dim 0 is
    # one part (heads, channels). Transfers between nodes of different TP sizes map ranks' shares by it.
    segments: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.dtype not in (MODEL_DTYPE, STATE_DTYPE):
            raise ValueError(f"state tensor {self.name!r} dtype: expected {MODEL_DTYPE!r} or {STATE_DTYPE!r}, "
                             f"got {self.dtype!r}")
        if self.segments and (not self.shape or sum(self.segments) != self.shape[0]):
            raise ValueError(f"state tensor {self.name!r} segments: expected parts summing to dim 0 of "
                             f"{self.shape}, got {self.segments}")

    @property
    def parts(self) -> tuple[int, ...]:
        """Dim 0's parts (this rank's sizes): `segments`, or dim 0 whole."""
        return self.segments or self.shape[:1]

    def torch_dtype(self, dtype: torch.dtype, state_dtype: torch.dtype) -> torch.dtype:
        return dtype if self.dtype == MODEL_DTYPE else state_dtype

    def nbytes(self, dtype: torch.dtype, state_dtype: torch.dtype) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.torch_dtype(dtype, state_dtype)).element_size()


@dataclass(frozen=True)
class StateSpec:
    num_layers: int                              # layers of the mixer, each with its own pool layer
    states: tuple[StateTensor, ...] = ()         # per slot and layer; they travel
    verify_inputs: tuple[StateTensor, ...] = ()  # per slot, layer and verified position, replayed; never travel

    def __post_init__(self) -> None:
        for kind, tensors in (("states", self.states), ("verify_inputs", self.verify_inputs)):
            names = [t.name for t in tensors]
            if len(set(names)) != len(names) or "kv" in names:
                raise ValueError(f"state spec {kind}: expected unique names other than 'kv', got {names}")

    def slot_bytes(self, dtype: torch.dtype, state_dtype: torch.dtype, verify_len: int) -> int:
        """One slot across all layers: its states and `verify_len` positions of verify inputs."""
        per_layer = sum(t.nbytes(dtype, state_dtype) for t in self.states)
        per_layer += verify_len * sum(t.nbytes(dtype, state_dtype) for t in self.verify_inputs)
        return self.num_layers * per_layer
