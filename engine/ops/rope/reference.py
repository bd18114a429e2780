"""Rotary position embedding of the first `rotary_dim` channels of each head (HF's `apply_rotary_pos_emb` with
`rotate_half`, as Qwen3.5 applies it), and each token's position from the batch's row layout.

Qwen3.5's multimodal RoPE gives a text token the same position on all three axes, which makes its rotation
exactly the plain one: `inv_freq[i] = theta^(-2i / rotary_dim)`, angle = position * inv_freq, cos/sin repeated
over the two halves. Angles in fp32; the rotated channels take the input's dtype, as HF casts cos/sin to it.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rope_inv_freq(theta: float, rotary_dim: int, device: torch.device | str = "cpu") -> Tensor:
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))


def token_positions(query_start_loc: Tensor, seq_lens: Tensor, num_tokens: int) -> Tensor:
    """[T] int64: each token's position in its sequence, from rows' query starts [R+1] and lengths [R] (context plus
    this step's tokens), on the device without a host sync (tokens past the last row take that row's)."""
    t = torch.arange(num_tokens, device=query_start_loc.device)
    rows = torch.searchsorted(query_start_loc[1:], t, right=True).clamp(max=seq_lens.shape[0] - 1)
    return seq_lens[rows] - query_start_loc[rows + 1] + t


def apply_rope(q: Tensor, k: Tensor, positions: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """q [T, Hq, D], k [T, Hk, D] -> rotated copies; the first 2 * len(inv_freq) channels of each head rotate."""
    rot = 2 * inv_freq.shape[0]
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, rot / 2]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(q.dtype)[:, None, :], emb.sin().to(q.dtype)[:, None, :]

    def rotate(x: Tensor) -> Tensor:
        x_rot, x_pass = x[..., :rot], x[..., rot:]
        half = rot // 2
        rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
        return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)

    return rotate(q), rotate(k)
