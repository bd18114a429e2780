"""One Mamba2 recurrence step per batch row, on a state pool indexed by slot (torch reference).

Per head h of a row, with `A < 0` and the head's group g = h // (H // G):

    dt  = max(softplus(dt_raw + dt_bias), dt_min)
    s   = exp(dt * A) * s + dt * outer(x, B[g])        # [P, N]
    y   = s @ C[g] + D * x                              # [P]

This is exactly one token of `mamba_chunk_scan_varlen`; both use `discretize_dt`, so a token's state
advance is the same whichever path computed it (HF's recurrent path skips the `dt_min` clamp; we don't).
State math runs in fp32 and the pool keeps its own dtype.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from baton.engine.ops.checks import check_shape
from baton.engine.ops.spec_verify import check_verify_indices, default_num_tokens


def discretize_dt(dt: Tensor, dt_bias: Tensor, dt_min: float) -> Tensor:
    """fp32 step sizes `max(softplus(dt + dt_bias), dt_min)`; `dt` is [..., H], `dt_bias` is [H]."""
    return F.softplus(dt.float() + dt_bias.float()).clamp(min=dt_min)



def _check_slots(state_slots: Tensor, num_slots: int) -> None:
    slots = state_slots.tolist()
    if any(s < 0 or s >= num_slots for s in slots):
        raise ValueError(f"selective_state_update: state_slots expected values in [0, {num_slots}), got {slots}")
    # Two rows on one slot would both read the old state and one write would be lost.
    if len(set(slots)) != len(slots):
        raise ValueError(f"selective_state_update: state_slots expected distinct slots, got {slots}")


def selective_state_update(
    ssm_state: Tensor,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor,
    dt_bias: Tensor,
    state_slots: Tensor,
    dt_min: float,
) -> Tensor:
    """Advance each row's state by one token and return that token's output.

    ssm_state [S, H, P, N] pool, updated in place at `state_slots` only; x [B, H, P]; dt [B, H] raw
    (before dt_bias and softplus); A, D, dt_bias [H]; B, C [B, G, N]; state_slots [B] distinct ints.
    Returns y [B, H, P] in x.dtype.
    """
    if x.dim() != 3 or ssm_state.dim() != 4 or B.dim() != 3:
        raise ValueError(
            "selective_state_update: expected x [B, H, P], ssm_state [S, H, P, N], B [B, G, N], "
            f"got x {tuple(x.shape)}, ssm_state {tuple(ssm_state.shape)}, B {tuple(B.shape)}"
        )
    batch, H, P = x.shape
    # The pool fixes the state size N; B fixes the group count G.
    S, N = ssm_state.shape[0], ssm_state.shape[3]
    G = B.shape[1]
    check_shape("selective_state_update", "ssm_state", ssm_state, "[S, H, P, N]", (S, H, P, N))
    check_shape("selective_state_update", "dt", dt, "[B, H]", (batch, H))
    check_shape("selective_state_update", "A", A, "[H]", (H,))
    check_shape("selective_state_update", "B", B, "[B, G, N]", (batch, G, N))
    check_shape("selective_state_update", "C", C, "[B, G, N]", (batch, G, N))
    check_shape("selective_state_update", "D", D, "[H]", (H,))
    check_shape("selective_state_update", "dt_bias", dt_bias, "[H]", (H,))
    check_shape("selective_state_update", "state_slots", state_slots, "[B]", (batch,))
    if G == 0 or H % G != 0:
        raise ValueError(f"selective_state_update: expected H ({H}) to be a multiple of G, got G = {G}")
    _check_slots(state_slots, S)

    slots = state_slots.long()
    dt = discretize_dt(dt, dt_bias, dt_min)  # [B, H]
    decay = torch.exp(dt * A.float())  # [B, H]
    # Each group's B and C serve H // G consecutive heads.
    B = B.float().repeat_interleave(H // G, dim=1)  # [B, H, N]
    C = C.float().repeat_interleave(H // G, dim=1)  # [B, H, N]
    x32 = x.float()  # [B, H, P]

    state = ssm_state[slots].float()  # [B, H, P, N]
    state = decay[:, :, None, None] * state + (dt[:, :, None] * x32)[..., None] * B[:, :, None, :]
    ssm_state[slots] = state.to(ssm_state.dtype)

    # The output reads the fp32 state, as the chunked scan does, not the pool's rounded copy.
    y = torch.einsum("bhpn,bhn->bhp", state, C) + D.float()[:, None] * x32  # [B, H, P]
    return y.to(x.dtype)


def _ssm_step(stored: Tensor, dt_raw: Tensor, x: Tensor, B: Tensor, A32: Tensor, dt_bias: Tensor,
              dt_min: float, heads_per_group: int) -> tuple[Tensor, Tensor]:
    """One decode step of [B, ...] rows from the pool-dtype `stored` state: (fp32 state, fp32 dt)."""
    dt_t = discretize_dt(dt_raw, dt_bias, dt_min)  # [B, H]
    decay = torch.exp(dt_t * A32)  # [B, H]
    B_t = B.float().repeat_interleave(heads_per_group, dim=1)  # [B, H, N]
    state = decay[:, :, None, None] * stored.float() + (dt_t[:, :, None] * x.float())[..., None] * B_t[:, :, None, :]
    return state, dt_t


def selective_state_update_verify(
    ssm_state: Tensor,
    pending_x: Tensor,
    pending_B: Tensor,
    pending_dt: Tensor,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor,
    dt_bias: Tensor,
    slots: Tensor,
    replay: Tensor,
    dt_min: float,
    num_tokens: Tensor | None = None,
) -> Tensor:
    """Replay each row's `replay[b]` pending positions into its state, then run its T verify tokens.

    ssm_state [S, H, P, N] pool; pending_x [S, L, H, P], pending_B [S, L, G, N], pending_dt [S, L, H] (raw dt)
    with L >= T, the inputs of each slot's last verify; x [B, T, H, P]; dt [B, T, H] raw (before dt_bias and
    softplus); A, D, dt_bias [H]; B, C [B, T, G, N]; slots [B] distinct; replay [B] in 0..L; num_tokens [B]
    in 1..T (None: all T). Writes ssm_state[slots] (the replayed state) and pending_*[slots, :T] (this
    step's inputs). Returns y [B, T, H, P] in x.dtype, zero past num_tokens.
    """
    fn = "selective_state_update_verify"
    if x.dim() != 4 or ssm_state.dim() != 4 or B.dim() != 4 or pending_x.dim() != 4:
        raise ValueError(
            f"{fn}: expected x [B, T, H, P], ssm_state [S, H, P, N], B [B, T, G, N], pending_x [S, L, H, P], "
            f"got x {tuple(x.shape)}, ssm_state {tuple(ssm_state.shape)}, B {tuple(B.shape)}, "
            f"pending_x {tuple(pending_x.shape)}"
        )
    batch, T, H, P = x.shape
    S, G, L = ssm_state.shape[0], B.shape[2], pending_x.shape[1]
    num_tokens = default_num_tokens(num_tokens, batch, T, x.device)
    check_verify_shapes(fn, ssm_state, pending_x, pending_B, pending_dt, x, dt, A, B, C, D, dt_bias, slots,
                        replay, num_tokens)
    check_verify_indices(fn, slots, replay, num_tokens, S, L, T)

    A32, D32, J = A.float(), D.float(), H // G
    idx = slots.long()
    # Every step runs on [B, ...] tensors shaped exactly as one `selective_state_update` call, so that on
    # CPU the elementwise exp/softplus round as a decode step's do (see the module docstring).
    stored = ssm_state[idx]  # [B, H, P, N], pool dtype
    for j in range(L):
        state, _ = _ssm_step(stored, pending_dt[idx, j], pending_x[idx, j], pending_B[idx, j], A32, dt_bias,
                             dt_min, J)
        stored = torch.where((j < replay)[:, None, None, None], state.to(ssm_state.dtype), stored)
    ssm_state[idx] = stored

    valid = torch.arange(T, device=x.device)[None, :] < num_tokens[:, None]  # [B, T]
    y = torch.zeros(batch, T, H, P, dtype=torch.float32, device=x.device)
    for t in range(T):
        state, _ = _ssm_step(stored, dt[:, t], x[:, t], B[:, t], A32, dt_bias, dt_min, J)
        # The next position reads what the pool would hold, as a decode step (and a later replay) does.
        stored = state.to(ssm_state.dtype)
        # The output reads the fp32 state, as the single-token op does, not the pool's rounded copy.
        C_t = C[:, t].float().repeat_interleave(J, dim=1)  # [B, H, N]
        y_t = torch.einsum("bhpn,bhn->bhp", state, C_t) + D32[:, None] * x[:, t].float()  # [B, H, P]
        y[:, t] = torch.where(valid[:, t, None, None], y_t, 0.0)
    # This step's inputs are the next step's pending ones (read above, before this write).
    pending_x[idx, :T] = x.to(pending_x.dtype)
    pending_B[idx, :T] = B.to(pending_B.dtype)
    pending_dt[idx, :T] = dt.to(pending_dt.dtype)
    return y.to(x.dtype)


def check_verify_shapes(fn: str, ssm_state: Tensor, pending_x: Tensor, pending_B: Tensor, pending_dt: Tensor,
                        x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor, dt_bias: Tensor,
                        slots: Tensor, replay: Tensor, num_tokens: Tensor | None) -> None:
    """Shape checks of `selective_state_update_verify`'s arguments (no host reads)."""
    batch, T, H, P = x.shape
    S, N = ssm_state.shape[0], ssm_state.shape[3]
    G, L = B.shape[2], pending_x.shape[1]
    check_shape(fn, "ssm_state", ssm_state, "[S, H, P, N]", (S, H, P, N))
    check_shape(fn, "pending_x", pending_x, "[S, L, H, P]", (S, L, H, P))
    check_shape(fn, "pending_B", pending_B, "[S, L, G, N]", (S, L, G, N))
    check_shape(fn, "pending_dt", pending_dt, "[S, L, H]", (S, L, H))
    check_shape(fn, "dt", dt, "[B, T, H]", (batch, T, H))
    check_shape(fn, "A", A, "[H]", (H,))
    check_shape(fn, "B", B, "[B, T, G, N]", (batch, T, G, N))
    check_shape(fn, "C", C, "[B, T, G, N]", (batch, T, G, N))
    check_shape(fn, "D", D, "[H]", (H,))
    check_shape(fn, "dt_bias", dt_bias, "[H]", (H,))
    check_shape(fn, "slots", slots, "[B]", (batch,))
    check_shape(fn, "replay", replay, "[B]", (batch,))
    if num_tokens is not None:
        check_shape(fn, "num_tokens", num_tokens, "[B]", (batch,))
    if T < 1:
        raise ValueError(f"{fn}: x expected at least one token per row (T >= 1), got {tuple(x.shape)}")
    if L < T:
        raise ValueError(f"{fn}: pending_x expected a pending length L >= T = {T}, got L = {L}")
    if G == 0 or H % G != 0:
        raise ValueError(f"{fn}: expected H ({H}) to be a multiple of G, got G = {G}")
