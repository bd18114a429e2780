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
