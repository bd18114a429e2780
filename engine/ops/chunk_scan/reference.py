"""Mamba2 chunked selective scan over a varlen batch of prefill rows (torch reference).

The recurrence is the one of `selective_state_update`, token after token; per head, with
a_t = dt_t * A (<= 0) and s the [P, N] state:

    s_t = exp(a_t) * s_{t-1} + dt_t * outer(x_t, B_t)        y_t = s_t @ C_t + D * x_t

The chunked ("SSD") form cuts each row into chunks of `chunk_size` tokens, counted from the row's own
first token, and computes in three phases, the same phases the GPU kernels use:

1. inside a chunk the output is a causal, decay-weighted "attention" of C over B, applied to dt * x,
   and each chunk's own contribution to the state at its end;
2. a short sequential pass over chunks carries the state from the row's initial state to every
   chunk's start (and past the last chunk: the row's final state);
3. each chunk-start state, decayed to position l and read out by C_l, adds the rest of y_l.

Everything runs in fp32; the final state goes back into the pool in the pool's dtype.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from baton.engine.ops.checks import check_shape
from baton.engine.ops.ssm_update.reference import discretize_dt

_FN = "mamba_chunk_scan_varlen"



def _check_rows(query_start_loc: Tensor, state_slots: Tensor, num_tokens: int, num_slots: int) -> None:
    starts = query_start_loc.tolist()
    if starts[0] != 0 or starts[-1] != num_tokens or any(a > b for a, b in zip(starts, starts[1:], strict=False)):
        raise ValueError(
            f"{_FN}: query_start_loc expected non-decreasing from 0 to T = {num_tokens}, got {starts}"
        )
    slots = state_slots.tolist()
    if any(s < 0 or s >= num_slots for s in slots):
        raise ValueError(f"{_FN}: state_slots expected values in [0, {num_slots}), got {slots}")
    # Two rows on one slot would race for the same state in any parallel implementation.
    if len(set(slots)) != len(slots):
        raise ValueError(f"{_FN}: state_slots expected distinct slots, got {slots}")


def _segment_sum(a: Tensor) -> Tensor:
    """[..., L] -> [..., L, L]: entry (l, s) = a[s+1] + ... + a[l] for s <= l, -inf above the diagonal.

    exp() of it is the decay from position s to position l. Summing the masked terms, rather than
    subtracting two cumulative sums, keeps it exact where the cumulative sums are large.
    """
    length = a.shape[-1]
    ones = torch.ones(length, length, dtype=torch.bool, device=a.device)
    # terms[..., k, s] = a[k], kept only where k > s: the steps taken after position s.
    terms = a[..., :, None].expand(*a.shape, length).masked_fill(~torch.tril(ones, diagonal=-1), 0.0)
    # Summing over k up to l gives the steps taken in (s, l].
    return terms.cumsum(dim=-2).masked_fill(~torch.tril(ones), float("-inf"))


def _scan_row(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, state: Tensor, chunk_size: int):
    """One row, fp32: x [L, H, P], dt [L, H] discretized, A [H], B and C [L, G, N], state [H, P, N].

    Heads are viewed as [G, J]: the J = H // G heads of group g share B[:, g] and C[:, g], so the
    C·B products are computed once per group. Returns (y without the D skip [L, H, P], final state).
    """
    length, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    J = H // G
    if length == 0:
        return x.new_zeros(0, H, P), state
    # A row that fits in one chunk is that one chunk; padding it to chunk_size would only add zeros.
    chunk_size = min(chunk_size, length)
    num_chunks = -(-length // chunk_size)
    pad = num_chunks * chunk_size - length

    # Padding tokens get dt = 0: decay exp(0) = 1 and no input, so they leave the state as it is.
    xdt = F.pad(x * dt[..., None], (0, 0, 0, 0, 0, pad)).view(num_chunks, chunk_size, G, J, P)
    a = F.pad(dt * A, (0, 0, 0, pad)).view(num_chunks, chunk_size, G, J)
    B = F.pad(B, (0, 0, 0, 0, 0, pad)).view(num_chunks, chunk_size, G, N)
    C = F.pad(C, (0, 0, 0, 0, 0, pad)).view(num_chunks, chunk_size, G, N)
    state = state.view(G, J, P, N)

    # Phase 1. decay[c, g, j, l, s]: from position s to position l of chunk c (0 when s > l).
    decay = torch.exp(_segment_sum(a.permute(0, 2, 3, 1)))  # [c, G, J, l, s]
    CB = torch.einsum("clgn,csgn->cgls", C, B)  # [c, G, l, s]
    y = torch.einsum("cgjls,csgjp->clgjp", CB[:, :, None] * decay, xdt)  # [c, l, G, J, P]
    # Each token's input decayed to the chunk's last position, summed: the chunk's own state.
    decay_to_end = decay[..., -1, :].permute(0, 3, 1, 2)  # [c, s, G, J]
    chunk_states = torch.einsum("csgjp,csgn->cgjpn", xdt * decay_to_end[..., None], B)  # [c, G, J, P, N]

    # Phase 2. Sequential over chunks; decay across a whole chunk is exp of the sum of its steps.
    chunk_decay = torch.exp(a.sum(dim=1))  # [c, G, J]
    start_states = []
    for c in range(num_chunks):
        start_states.append(state)
        state = chunk_decay[c][..., None, None] * state + chunk_states[c]
    starts = torch.stack(start_states)  # [c, G, J, P, N]

    # Phase 3. Decay from the chunk's start to position l, inclusive, is exp of the running sum.
    decay_from_start = torch.exp(a.cumsum(dim=1))  # [c, l, G, J]
    y = y + torch.einsum("clgn,cgjpn->clgjp", C, starts) * decay_from_start[..., None]
    return y.reshape(num_chunks * chunk_size, H, P)[:length], state.reshape(H, P, N)


def mamba_chunk_scan_varlen(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor,
    dt_bias: Tensor,
    query_start_loc: Tensor,
    ssm_state: Tensor,
    state_slots: Tensor,
    has_initial_state: Tensor,
    chunk_size: int,
    dt_min: float,
) -> Tensor:
    """Scan every prefill row of a varlen batch; write each row's final state into its pool slot.

    x [T, H, P]; dt [T, H] raw (before dt_bias and softplus); A, D, dt_bias [H]; B, C [T, G, N];
    query_start_loc [R+1] (row r owns tokens query_start_loc[r]:query_start_loc[r+1]);
    ssm_state [S, H, P, N] pool; state_slots [R] distinct; has_initial_state [R] bool (False: the row
    starts from zeros and its slot's old contents are never read). Returns y [T, H, P] in x.dtype.
    """
    if x.dim() != 3 or B.dim() != 3 or ssm_state.dim() != 4 or state_slots.dim() != 1:
        raise ValueError(
            f"{_FN}: expected x [T, H, P], B [T, G, N], ssm_state [S, H, P, N], state_slots [R], got "
            f"x {tuple(x.shape)}, B {tuple(B.shape)}, ssm_state {tuple(ssm_state.shape)}, "
            f"state_slots {tuple(state_slots.shape)}"
        )
    T, H, P = x.shape
    # The pool fixes the state size N; B fixes the group count G.
    S, N = ssm_state.shape[0], ssm_state.shape[3]
    G = B.shape[1]
    R = state_slots.shape[0]
    check_shape(_FN, "ssm_state", ssm_state, "[S, H, P, N]", (S, H, P, N))
    check_shape(_FN, "dt", dt, "[T, H]", (T, H))
    check_shape(_FN, "A", A, "[H]", (H,))
    check_shape(_FN, "B", B, "[T, G, N]", (T, G, N))
    check_shape(_FN, "C", C, "[T, G, N]", (T, G, N))
    check_shape(_FN, "D", D, "[H]", (H,))
    check_shape(_FN, "dt_bias", dt_bias, "[H]", (H,))
    check_shape(_FN, "query_start_loc", query_start_loc, "[R+1]", (R + 1,))
    check_shape(_FN, "has_initial_state", has_initial_state, "[R]", (R,))
    if G == 0 or H % G != 0:
        raise ValueError(f"{_FN}: expected H ({H}) to be a multiple of G, got G = {G}")
    if chunk_size <= 0:
        raise ValueError(f"{_FN}: expected chunk_size > 0, got {chunk_size}")
    _check_rows(query_start_loc, state_slots, T, S)

    bounds = query_start_loc.tolist()
    slots = state_slots.tolist()
    has_init = has_initial_state.tolist()
    A32 = A.float()
    x32 = x.float()  # [T, H, P]
    dt32 = discretize_dt(dt, dt_bias, dt_min)  # [T, H]
    B32, C32 = B.float(), C.float()  # [T, G, N]

    y = torch.empty(T, H, P, dtype=torch.float32, device=x.device)
    for r in range(R):
        lo, hi = bounds[r], bounds[r + 1]
        if has_init[r]:
            state = ssm_state[slots[r]].float()
        else:
            state = torch.zeros(H, P, N, dtype=torch.float32, device=x.device)
        y[lo:hi], final = _scan_row(x32[lo:hi], dt32[lo:hi], A32, B32[lo:hi], C32[lo:hi], state, chunk_size)
        ssm_state[slots[r]] = final.to(ssm_state.dtype)

    y += D.float()[:, None] * x32
    return y.to(x.dtype)
