"""Depthwise causal conv1d + SiLU of the Mamba2 mixer, on a conv-state pool (torch reference).

Per channel c, with kernel width K and the row's inputs u (oldest first):

    out_t = silu(bias[c] + sum_k weight[c, k] * u[t - (K-1) + k])

Inputs before the row's first token come from the pool: `conv_state[slot]` [C, K-1] holds the K-1
inputs that precede it, oldest first (HF's `conv_state[:, :, -state_len:]` convention), or zeros for
a row without initial state. After the call the slot holds the row's last K-1 inputs, so the next
chunk or decode step continues exactly where this one stopped. Math in fp32; the output takes
x.dtype and the pool keeps its own dtype.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from baton.engine.ops.checks import check_shape
from baton.engine.ops.spec_verify import check_verify_indices, default_num_tokens


def _check_slots(fn: str, state_slots: Tensor, num_slots: int) -> list[int]:
    slots = state_slots.tolist()
    if any(s < 0 or s >= num_slots for s in slots):
        raise ValueError(f"{fn}: state_slots expected values in [0, {num_slots}), got {slots}")
    # Two rows on one slot would both read the old state and one write would be lost.
    if len(set(slots)) != len(slots):
        raise ValueError(f"{fn}: state_slots expected distinct slots, got {slots}")
    return slots


def _check_common(fn: str, x: Tensor, weight: Tensor, bias: Tensor | None, conv_state: Tensor) -> None:
    if x.dim() != 2 or weight.dim() != 2 or conv_state.dim() != 3:
        raise ValueError(
            f"{fn}: expected x [T, C], weight [C, K], conv_state [S, C, K-1], got x {tuple(x.shape)}, "
            f"weight {tuple(weight.shape)}, conv_state {tuple(conv_state.shape)}"
        )
    channels, width = x.shape[1], weight.shape[1]
    if width < 1:
        raise ValueError(f"{fn}: weight expected kernel width K >= 1, got {tuple(weight.shape)}")
    check_shape(fn, "weight", weight, "[C, K]", (channels, width))
    check_shape(fn, "conv_state", conv_state, "[S, C, K-1]", (conv_state.shape[0], channels, width - 1))
    if bias is not None:
        check_shape(fn, "bias", bias, "[C]", (channels,))


def causal_conv1d_varlen(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    conv_state: Tensor,
    query_start_loc: Tensor,
    state_slots: Tensor,
    has_initial_state: Tensor,
) -> Tensor:
    """silu(causal conv) of every prefill row of a varlen batch; each row's slot gets its last K-1 inputs.

    x [T, C]; weight [C, K]; bias [C] or None; conv_state [S, C, K-1] pool; query_start_loc [R+1];
    state_slots [R] distinct; has_initial_state [R] bool (False: zeros precede the row and its slot's
    old contents are never read). A row shorter than K-1 keeps the tail of its preceding inputs in
    the state. Returns [T, C] in x.dtype.
    """
    fn = "causal_conv1d_varlen"
    _check_common(fn, x, weight, bias, conv_state)
    T, channels = x.shape
    width = weight.shape[1]
    if state_slots.dim() != 1:
        raise ValueError(f"{fn}: state_slots expected shape [R], got {tuple(state_slots.shape)}")
    R = state_slots.shape[0]
    check_shape(fn, "query_start_loc", query_start_loc, "[R+1]", (R + 1,))
    check_shape(fn, "has_initial_state", has_initial_state, "[R]", (R,))
    bounds = query_start_loc.tolist()
    if bounds[0] != 0 or bounds[-1] != T or any(a > b for a, b in zip(bounds, bounds[1:], strict=False)):
        raise ValueError(f"{fn}: query_start_loc expected non-decreasing from 0 to T = {T}, got {bounds}")
    slots = _check_slots(fn, state_slots, conv_state.shape[0])
    has_init = has_initial_state.tolist()

    w = weight.float()  # [C, K]
    x32 = x.float()  # [T, C]
    out = torch.empty(T, channels, dtype=torch.float32, device=x.device)
    for r in range(R):
        lo, hi = bounds[r], bounds[r + 1]
        if has_init[r]:
            preceding = conv_state[slots[r]].float().T  # [K-1, C]
        else:
            preceding = torch.zeros(width - 1, channels, dtype=torch.float32, device=x.device)
        inputs = torch.cat([preceding, x32[lo:hi]])  # [K-1 + L, C]
        # Window t covers inputs t .. t+K-1, i.e. the row's token t and the K-1 inputs before it.
        windows = inputs.unfold(0, width, 1)  # [L, C, K]
        out[lo:hi] = (windows * w).sum(dim=-1)
        # Slicing from an explicit start, because [-(K-1):] would keep everything when K == 1.
        conv_state[slots[r]] = inputs[inputs.shape[0] - (width - 1) :].T.to(conv_state.dtype)

    if bias is not None:
        out += bias.float()
    return F.silu(out).to(x.dtype)


def causal_conv1d_update(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    conv_state: Tensor,
    state_slots: Tensor,
) -> Tensor:
    """One token per row: silu(conv) over the slot's K-1 stored inputs and x; shifts x into the slot.

    x [B, C]; weight [C, K]; bias [C] or None; conv_state [S, C, K-1] pool; state_slots [B] distinct.
    Returns [B, C] in x.dtype.
    """
    fn = "causal_conv1d_update"
    _check_common(fn, x, weight, bias, conv_state)
    batch = x.shape[0]
    check_shape(fn, "state_slots", state_slots, "[B]", (batch,))
    _check_slots(fn, state_slots, conv_state.shape[0])

    slots = state_slots.long()
    window = torch.cat([conv_state[slots].float(), x.float()[:, :, None]], dim=-1)  # [B, C, K]
    out = (window * weight.float()).sum(dim=-1)  # [B, C]
    if bias is not None:
        out += bias.float()
    # Drop the oldest input; the new token becomes the newest.
    conv_state[slots] = window[:, :, 1:].to(conv_state.dtype)
    return F.silu(out).to(x.dtype)


def causal_conv1d_update_verify(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    conv_state: Tensor,
    pending: Tensor,
    slots: Tensor,
    replay: Tensor,
    num_tokens: Tensor | None = None,
) -> Tensor:
    """silu(causal conv) over each row's T verify tokens, after replaying its `replay[b]` pending inputs.

    x [B, T, C]; weight [C, K]; bias [C] or None; conv_state [S, C, K-1] pool (oldest input first);
    pending [S, L, C] (L >= T), the conv inputs of each slot's last verify; slots [B] distinct; replay [B]
    in 0..L; num_tokens [B] in 1..T (None: all T). Writes conv_state[slots] (the window after the replay)
    and pending[slots, :T] (this step's inputs). Returns [B, T, C] in x.dtype, zero past num_tokens.
    """
    fn = "causal_conv1d_update_verify"
    if x.dim() != 3 or weight.dim() != 2 or conv_state.dim() != 3 or pending.dim() != 3:
        raise ValueError(
            f"{fn}: expected x [B, T, C], weight [C, K], conv_state [S, C, K-1], pending [S, L, C], got "
            f"x {tuple(x.shape)}, weight {tuple(weight.shape)}, conv_state {tuple(conv_state.shape)}, "
            f"pending {tuple(pending.shape)}"
        )
    batch, T, channels = x.shape
    width = weight.shape[1]
    S, L = conv_state.shape[0], pending.shape[1]
    num_tokens = default_num_tokens(num_tokens, batch, T, x.device)
    if width < 1:
        raise ValueError(f"{fn}: weight expected kernel width K >= 1, got {tuple(weight.shape)}")
    check_shape(fn, "weight", weight, "[C, K]", (channels, width))
    check_shape(fn, "conv_state", conv_state, "[S, C, K-1]", (S, channels, width - 1))
    check_shape(fn, "pending", pending, "[S, L, C]", (S, L, channels))
    if bias is not None:
        check_shape(fn, "bias", bias, "[C]", (channels,))
    check_shape(fn, "slots", slots, "[B]", (batch,))
    check_shape(fn, "replay", replay, "[B]", (batch,))
    check_shape(fn, "num_tokens", num_tokens, "[B]", (batch,))
    if T < 1:
        raise ValueError(f"{fn}: x expected at least one token per row (T >= 1), got {tuple(x.shape)}")
    if L < T:
        raise ValueError(f"{fn}: pending expected a pending length L >= T = {T}, got L = {L}")
    check_verify_indices(fn, slots, replay, num_tokens, S, L, T)

    idx = slots.long()
    w = weight.float()  # [C, K]
    stored = conv_state[idx]  # [B, C, K-1], pool dtype
    for j in range(L):
        # Shift the pending input in (rounded to the pool dtype, as a decode step stores it).
        window = torch.cat([stored, pending[idx, j][:, :, None].to(conv_state.dtype)], dim=-1)[:, :, 1:]
        stored = torch.where((j < replay)[:, None, None], window, stored)
    conv_state[idx] = stored

    valid = torch.arange(T, device=x.device)[None, :] < num_tokens[:, None]  # [B, T]
    y = torch.zeros(batch, T, channels, dtype=x.dtype, device=x.device)
    for t in range(T):
        # Per-step [B, C] tensors shaped as one `causal_conv1d_update` call, so silu rounds the same way.
        window = torch.cat([stored.float(), x[:, t].float()[:, :, None]], dim=-1)  # [B, C, K]
        out = (window * w).sum(dim=-1)  # [B, C]
        if bias is not None:
            out += bias.float()
        stored = window[:, :, 1:].to(conv_state.dtype)  # [B, C, K-1]
        y[:, t] = torch.where(valid[:, t, None], F.silu(out).to(x.dtype), 0.0)
    pending[idx, :T] = x.to(pending.dtype)
    return y
