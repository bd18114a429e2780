"""Counter-based uniform noise: U[0, 1) as a pure function of (seed, position, stream).

Sampling (every engine's draw, and speculative sampling's accept tests) takes a request's random numbers from its
seed and the position of the token they decide, not from a generator object that advances with every call. So the
noise of a decision about a token is the same whatever batch and whatever step it is made in, without per-request
state, and it is made of a few integer ops on tensors of the batch's size: no per-row host loop, no generator,
nothing that a CUDA graph cannot hold.

The hash: each of the stream, the position and the seed's two 32-bit halves is XORed in and mixed by lowbias32
(Chris Wellons' 32-bit integer hash, a bijection with good avalanche). For one seed and stream, distinct positions
below 2^32 give distinct words. All arithmetic stays in int64 without overflow (32-bit products are taken in two
16-bit halves), so CPU and GPU give the same bits.
"""

from __future__ import annotations

import torch
from torch import Tensor

MASK32 = 0xFFFFFFFF
# Streams: independent noise for the different decisions about one token.
ACCEPT = 0  # the accept test of the draft at this position
DRAW = 1    # the draw of the token at this position (a rejected draft's replacement, or the bonus token)
_STREAM_KEYS = (0x68E31DA4, 0xB5297A4D)


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32) and a 32-bit constant c, without an int64 overflow."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & MASK32


def _mix32(x: Tensor) -> Tensor:
    """lowbias32 on words in [0, 2^32) held in int64."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform(seeds: Tensor, positions: Tensor, stream: int) -> Tensor:
    """seeds and positions: int64 tensors of broadcastable shapes (any 64-bit seed; positions >= 0), on one
    device -> float32 noise in [0, 1) of the broadcast shape, a multiple of 2^-24 (exact in float32)."""
    if seeds.dtype != torch.int64 or positions.dtype != torch.int64:
        raise ValueError(f"seeds, positions: expected int64 tensors, got {seeds.dtype} and {positions.dtype}")
    if stream not in (ACCEPT, DRAW):
        raise ValueError(f"stream: expected ACCEPT ({ACCEPT}) or DRAW ({DRAW}), got {stream!r}")
    x = _mix32((positions & MASK32) ^ _STREAM_KEYS[stream])
    x = _mix32(x ^ (seeds & MASK32))
    x = _mix32(x ^ ((seeds >> 32) & MASK32))
    return (x >> 8).to(torch.float32) * (1.0 / (1 << 24))

