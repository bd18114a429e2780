"""Speculative-verify state updates for Mamba2 layers: T = 1+K tokens per row, one state slot per position.

A verify row feeds the last accepted token and K drafts. Which of them the target accepts is only
known after the forward, so the state after EACH position t goes to its own slot `dst_slots[b, t]`
(DESIGN.md R4); the next step resumes from `dst_slots[b, a]` for a accepted drafts. Every row starts
from `src_slots[b]` (the slot its previous step resumed from), which may be one of its own dst slots.

Both ops are, position by position, exactly the single-token ops (`selective_state_update`,
`causal_conv1d_update`) applied T times: each step reads the state as the pool would hold it (rounded
to the pool dtype) and stores it rounded again, so a verify row resumed at position a is bit-for-bit
the non-speculative decode over the same a+1 tokens, in every dtype, given the same batch rows (on
CPU a vectorized exp/silu can round an element differently by its place in the tensor, so a batch of
another size may differ in the last ulp; that holds for the single-token ops themselves too).

Rows may be shorter than T (`num_tokens[b]` in 1..T): positions >= num_tokens[b] are not computed
into the pool, their dst entries are never read (padding such as -1 is fine) and their y is zero.

Slot contract (a GPU kernel runs rows in parallel, so the reference forbids what would race there):
the dst slots of all valid positions are distinct, and no row's dst slot is another row's src slot.
A row's src slot may equal one of its own dst slots: it is read before any write.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from baton.engine.ops.checks import check_shape
from baton.engine.ops.selective_state_update import discretize_dt


def _check_slots(fn: str, src_slots: Tensor, dst_slots: Tensor, num_tokens: Tensor, num_slots: int) -> Tensor:
    """Validate the slot indices against the contract above; returns the [B, T] bool mask of valid positions."""
    batch, T = dst_slots.shape
    counts = num_tokens.tolist()
    if any(n < 1 or n > T for n in counts):
        raise ValueError(f"{fn}: num_tokens expected values in [1, {T}], got {counts}")
    src = src_slots.tolist()
    if any(s < 0 or s >= num_slots for s in src):
        raise ValueError(f"{fn}: src_slots expected values in [0, {num_slots}), got {src}")
    dst = [row[:n] for row, n in zip(dst_slots.tolist(), counts, strict=True)]
    flat = [s for row in dst for s in row]
    if any(s < 0 or s >= num_slots for s in flat):
        raise ValueError(f"{fn}: dst_slots expected values in [0, {num_slots}) at valid positions, got {dst}")
    # Two positions writing one slot would lose a state (and the winner would depend on the kernel).
    if len(set(flat)) != len(flat):
        raise ValueError(f"{fn}: dst_slots expected distinct slots at valid positions, got {dst}")
    for b, row in enumerate(dst):
        # Another row reading a slot this row writes would race in a parallel kernel.
        if any(src[o] in row for o in range(batch) if o != b):
            raise ValueError(f"{fn}: dst_slots of row {b} ({row}) overlap another row's src_slots {src}")
    positions = torch.arange(T, device=dst_slots.device)
    return positions[None, :] < num_tokens.to(dst_slots.device)[:, None]  # [B, T]


def _default_num_tokens(num_tokens: Tensor | None, batch: int, T: int, device: torch.device) -> Tensor:
    if num_tokens is None:
        return torch.full((batch,), T, dtype=torch.int64, device=device)
    return num_tokens


def selective_state_update_multi(
    ssm_state: Tensor,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor,
    dt_bias: Tensor,
    src_slots: Tensor,
    dst_slots: Tensor,
    dt_min: float,
    num_tokens: Tensor | None = None,
) -> Tensor:
    """Advance each row's SSM state over its T verify tokens, storing the state after each position.

    ssm_state [S, H, P, N] pool, written only at the valid dst slots; x [B, T, H, P]; dt [B, T, H] raw
    (before dt_bias and softplus); A, D, dt_bias [H]; B, C [B, T, G, N]; src_slots [B]; dst_slots [B, T];
    num_tokens [B] in 1..T (None: all T). Returns y [B, T, H, P] in x.dtype, zero past num_tokens.
    """
    fn = "selective_state_update_multi"
    if x.dim() != 4 or ssm_state.dim() != 4 or B.dim() != 4:
        raise ValueError(
            f"{fn}: expected x [B, T, H, P], ssm_state [S, H, P, N], B [B, T, G, N], "
            f"got x {tuple(x.shape)}, ssm_state {tuple(ssm_state.shape)}, B {tuple(B.shape)}"
        )
    batch, T, H, P = x.shape
    # The pool fixes the state size N; B fixes the group count G.
    S, N = ssm_state.shape[0], ssm_state.shape[3]
    G = B.shape[2]
    num_tokens = _default_num_tokens(num_tokens, batch, T, x.device)
    check_shape(fn, "ssm_state", ssm_state, "[S, H, P, N]", (S, H, P, N))
    check_shape(fn, "dt", dt, "[B, T, H]", (batch, T, H))
    check_shape(fn, "A", A, "[H]", (H,))
    check_shape(fn, "B", B, "[B, T, G, N]", (batch, T, G, N))
    check_shape(fn, "C", C, "[B, T, G, N]", (batch, T, G, N))
    check_shape(fn, "D", D, "[H]", (H,))
    check_shape(fn, "dt_bias", dt_bias, "[H]", (H,))
    check_shape(fn, "src_slots", src_slots, "[B]", (batch,))
    check_shape(fn, "dst_slots", dst_slots, "[B, T]", (batch, T))
    check_shape(fn, "num_tokens", num_tokens, "[B]", (batch,))
    if T < 1:
        raise ValueError(f"{fn}: x expected at least one token per row (T >= 1), got {tuple(x.shape)}")
    if G == 0 or H % G != 0:
        raise ValueError(f"{fn}: expected H ({H}) to be a multiple of G, got G = {G}")
    valid = _check_slots(fn, src_slots, dst_slots, num_tokens, S)  # [B, T]

    # Every step below runs on [B, ...] tensors shaped exactly as one `selective_state_update` call:
    # on CPU an elementwise exp/softplus may round an element differently by where it sits in the
    # tensor (vectorized body vs scalar tail), so hoisting them over [B, T, ...] would cost the bit
    # equality. All B rows step together (finished rows too, masked at the write) for the same reason.
    A32 = A.float()  # [H]
    D32 = D.float()  # [H]
    # Read every source before the first write: a row's src slot may be one of its dst slots.
    stored = ssm_state[src_slots.long()]  # [B, H, P, N], pool dtype
    dst = dst_slots.long()
    y = torch.zeros(batch, T, H, P, dtype=torch.float32, device=x.device)
    for t in range(T):
        dt_t = discretize_dt(dt[:, t], dt_bias, dt_min)  # [B, H]
        decay = torch.exp(dt_t * A32)  # [B, H]
        # Each group's B and C serve H // G consecutive heads.
        B_t = B[:, t].float().repeat_interleave(H // G, dim=1)  # [B, H, N]
        C_t = C[:, t].float().repeat_interleave(H // G, dim=1)  # [B, H, N]
        x_t = x[:, t].float()  # [B, H, P]
        state = stored.float()  # [B, H, P, N]
        state = decay[:, :, None, None] * state + (dt_t[:, :, None] * x_t)[..., None] * B_t[:, :, None, :]
        # The next position reads what the pool would hold, so resuming from any dst slot is exact.
        stored = state.to(ssm_state.dtype)
        rows = valid[:, t]  # [B]
        ssm_state[dst[rows, t]] = stored[rows]
        # The output reads the fp32 state, as the single-token op does, not the pool's rounded copy.
        y_t = torch.einsum("bhpn,bhn->bhp", state, C_t) + D32[:, None] * x_t  # [B, H, P]
        y[:, t] = torch.where(rows[:, None, None], y_t, 0.0)
    return y.to(x.dtype)


def causal_conv1d_update_multi(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    conv_state: Tensor,
    src_slots: Tensor,
    dst_slots: Tensor,
    num_tokens: Tensor | None = None,
) -> Tensor:
    """silu(causal conv) over each row's T verify tokens, storing the K-1 input window after each position.

    x [B, T, C]; weight [C, K]; bias [C] or None; conv_state [S, C, K-1] pool (oldest input first),
    written only at the valid dst slots; src_slots [B]; dst_slots [B, T]; num_tokens [B] in 1..T
    (None: all T). Returns [B, T, C] in x.dtype, zero past num_tokens.
    """
    fn = "causal_conv1d_update_multi"
    if x.dim() != 3 or weight.dim() != 2 or conv_state.dim() != 3:
        raise ValueError(
            f"{fn}: expected x [B, T, C], weight [C, K], conv_state [S, C, K-1], got x {tuple(x.shape)}, "
            f"weight {tuple(weight.shape)}, conv_state {tuple(conv_state.shape)}"
        )
    batch, T, channels = x.shape
    width = weight.shape[1]
    S = conv_state.shape[0]
    num_tokens = _default_num_tokens(num_tokens, batch, T, x.device)
    if width < 1:
        raise ValueError(f"{fn}: weight expected kernel width K >= 1, got {tuple(weight.shape)}")
    check_shape(fn, "weight", weight, "[C, K]", (channels, width))
    check_shape(fn, "conv_state", conv_state, "[S, C, K-1]", (S, channels, width - 1))
    if bias is not None:
        check_shape(fn, "bias", bias, "[C]", (channels,))
    check_shape(fn, "src_slots", src_slots, "[B]", (batch,))
    check_shape(fn, "dst_slots", dst_slots, "[B, T]", (batch, T))
    check_shape(fn, "num_tokens", num_tokens, "[B]", (batch,))
    if T < 1:
        raise ValueError(f"{fn}: x expected at least one token per row (T >= 1), got {tuple(x.shape)}")
    valid = _check_slots(fn, src_slots, dst_slots, num_tokens, S)  # [B, T]

    w = weight.float()  # [C, K]
    # Per-step [B, C] tensors shaped as one `causal_conv1d_update` call, so silu rounds the same way.
    # Read every source before the first write: a row's src slot may be one of its dst slots.
    stored = conv_state[src_slots.long()]  # [B, C, K-1], pool dtype
    dst = dst_slots.long()
    y = torch.zeros(batch, T, channels, dtype=x.dtype, device=x.device)
    for t in range(T):
        window = torch.cat([stored.float(), x[:, t].float()[:, :, None]], dim=-1)  # [B, C, K]
        out = (window * w).sum(dim=-1)  # [B, C]
        if bias is not None:
            out += bias.float()
        # Drop the oldest input; the next position reads the window as the pool would hold it.
        stored = window[:, :, 1:].to(conv_state.dtype)  # [B, C, K-1]
        rows = valid[:, t]  # [B]
        conv_state[dst[rows, t]] = stored[rows]
        y[:, t] = torch.where(rows[:, None], F.silu(out).to(x.dtype), 0.0)
    return y
