"""The Gated DeltaNet ops' shape checks, shared by the torch references and the Triton kernels (which skip the
references' host reads of index values). Each returns the sizes it read and raises a `ValueError` naming the
argument, its expected shape and the one it got."""

from __future__ import annotations

from torch import Tensor

from baton.engine.ops.checks import check_shape


def check_heads(fn: str, Hv: int, Hk: int) -> None:
    if Hk == 0 or Hv % Hk != 0:
        raise ValueError(f"{fn}: expected Hv ({Hv}) to be a multiple of Hk, got Hk = {Hk}")


def _check_tokens(fn: str, lead: str, state: Tensor, q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor,
                  A_log: Tensor, dt_bias: Tensor) -> tuple[int, int, int, int, int, int]:
    """Per-token inputs [N, ...] (N named `lead`) over a state pool: (N, Hk, Dk, Hv, Dv, S)."""
    n, Hk, Dk = q.shape
    Hv, Dv = v.shape[1], v.shape[2]
    S = state.shape[0]
    check_shape(fn, "state", state, "[S, Hv, Dk, Dv]", (S, Hv, Dk, Dv))
    check_shape(fn, "k", k, f"[{lead}, Hk, Dk]", (n, Hk, Dk))
    check_shape(fn, "v", v, f"[{lead}, Hv, Dv]", (n, Hv, Dv))
    check_shape(fn, "a", a, f"[{lead}, Hv]", (n, Hv))
    check_shape(fn, "b", b, f"[{lead}, Hv]", (n, Hv))
    check_shape(fn, "A_log", A_log, "[Hv]", (Hv,))
    check_shape(fn, "dt_bias", dt_bias, "[Hv]", (Hv,))
    check_heads(fn, Hv, Hk)
    return n, Hk, Dk, Hv, Dv, S


def check_decode_shapes(fn: str, state: Tensor, q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor,
                        A_log: Tensor, dt_bias: Tensor, state_slots: Tensor) -> tuple[int, int, int, int, int, int]:
    """(B, Hk, Dk, Hv, Dv, S) of a decode call."""
    if q.dim() != 3 or v.dim() != 3 or state.dim() != 4:
        raise ValueError(
            f"{fn}: expected q [B, Hk, Dk], v [B, Hv, Dv], state [S, Hv, Dk, Dv], "
            f"got q {tuple(q.shape)}, v {tuple(v.shape)}, state {tuple(state.shape)}"
        )
    check_shape(fn, "state_slots", state_slots, "[B]", (q.shape[0],))
    return _check_tokens(fn, "B", state, q, k, v, a, b, A_log, dt_bias)


def check_prefill_shapes(fn: str, state: Tensor, q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor,
                         A_log: Tensor, dt_bias: Tensor, query_start_loc: Tensor, state_slots: Tensor,
                         has_initial_state: Tensor, chunk_size: int) -> tuple[int, int, int, int, int, int, int]:
    """(T, Hk, Dk, Hv, Dv, S, R) of a varlen prefill call."""
    if q.dim() != 3 or v.dim() != 3 or state.dim() != 4 or state_slots.dim() != 1:
        raise ValueError(
            f"{fn}: expected q [T, Hk, Dk], v [T, Hv, Dv], state [S, Hv, Dk, Dv], state_slots [R], got "
            f"q {tuple(q.shape)}, v {tuple(v.shape)}, state {tuple(state.shape)}, "
            f"state_slots {tuple(state_slots.shape)}"
        )
    R = state_slots.shape[0]
    sizes = _check_tokens(fn, "T", state, q, k, v, a, b, A_log, dt_bias)
    check_shape(fn, "query_start_loc", query_start_loc, "[R+1]", (R + 1,))
    check_shape(fn, "has_initial_state", has_initial_state, "[R]", (R,))
    if chunk_size <= 0:
        raise ValueError(f"{fn}: expected chunk_size > 0, got {chunk_size}")
    return (*sizes, R)


def check_verify_shapes(fn: str, state: Tensor, pending_k: Tensor, pending_v: Tensor, pending_a: Tensor,
                        pending_b: Tensor, q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, A_log: Tensor,
                        dt_bias: Tensor, slots: Tensor, replay: Tensor, num_tokens: Tensor | None
                        ) -> tuple[int, int, int, int, int, int, int]:
    """(B, T, Hk, Dk, Hv, Dv, L) of a verify call; num_tokens None: all T."""
    if q.dim() != 4 or v.dim() != 4 or state.dim() != 4 or pending_k.dim() != 4:
        raise ValueError(
            f"{fn}: expected q [B, T, Hk, Dk], v [B, T, Hv, Dv], state [S, Hv, Dk, Dv], pending_k [S, L, Hk, Dk], "
            f"got q {tuple(q.shape)}, v {tuple(v.shape)}, state {tuple(state.shape)}, "
            f"pending_k {tuple(pending_k.shape)}"
        )
    batch, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2], v.shape[3]
    S, L = state.shape[0], pending_k.shape[1]
    check_shape(fn, "state", state, "[S, Hv, Dk, Dv]", (S, Hv, Dk, Dv))
    check_shape(fn, "pending_k", pending_k, "[S, L, Hk, Dk]", (S, L, Hk, Dk))
    check_shape(fn, "pending_v", pending_v, "[S, L, Hv, Dv]", (S, L, Hv, Dv))
    check_shape(fn, "pending_a", pending_a, "[S, L, Hv]", (S, L, Hv))
    check_shape(fn, "pending_b", pending_b, "[S, L, Hv]", (S, L, Hv))
    check_shape(fn, "k", k, "[B, T, Hk, Dk]", (batch, T, Hk, Dk))
    check_shape(fn, "v", v, "[B, T, Hv, Dv]", (batch, T, Hv, Dv))
    check_shape(fn, "a", a, "[B, T, Hv]", (batch, T, Hv))
    check_shape(fn, "b", b, "[B, T, Hv]", (batch, T, Hv))
    check_shape(fn, "A_log", A_log, "[Hv]", (Hv,))
    check_shape(fn, "dt_bias", dt_bias, "[Hv]", (Hv,))
    check_shape(fn, "slots", slots, "[B]", (batch,))
    check_shape(fn, "replay", replay, "[B]", (batch,))
    if num_tokens is not None:
        check_shape(fn, "num_tokens", num_tokens, "[B]", (batch,))
    if T < 1:
        raise ValueError(f"{fn}: q expected at least one token per row (T >= 1), got {tuple(q.shape)}")
    if L < T:
        raise ValueError(f"{fn}: pending_k expected a pending length L >= T = {T}, got L = {L}")
    check_heads(fn, Hv, Hk)
    return batch, T, Hk, Dk, Hv, Dv, L
