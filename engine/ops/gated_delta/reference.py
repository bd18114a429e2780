"""Gated DeltaNet (GDN) recurrence on a state pool indexed by slot: decode, varlen chunked prefill and verify by
replay (torch references, the math of HF Qwen3.5's `torch_*_gated_delta_rule`).

Per token t and value head h, whose key head is h // (Hv // Hk), from the RAW inputs (all in fp32):

    q_t = l2norm(q) * Dk^-0.5        k_t = l2norm(k)            (eps 1e-6)
    g_t = -exp(A_log) * softplus(a_t + dt_bias)                 beta_t = sigmoid(b_t)
    S   = exp(g_t) * S               S = S + outer(k_t, beta_t * (v_t - S^T k_t))        o_t = S^T q_t

with S the head's [Dk, Dv] state. The pool keeps its own dtype: a step reads the stored state, computes in fp32 and
stores it rounded; the output reads the fp32 state. The chunked prefill is the same recurrence, token after token,
computed per chunk of `chunk_size` tokens counted from each row's first token. The verify op follows
`ops.spec_verify`: each replayed position is exactly one `gated_delta_decode` step (bit for bit, given the same
batch rows).
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from baton.engine.ops.gated_delta.checks import check_decode_shapes, check_prefill_shapes, check_verify_shapes
from baton.engine.ops.spec_verify import check_verify_indices, default_num_tokens

_L2_EPS = 1e-6


def gdn_gates(a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    """fp32 (g, beta) from the raw projections a, b [..., Hv]: the log decay g <= 0 and the write strength beta
    (its sigmoid taken in b's dtype, as HF's `b.sigmoid()`)."""
    g = -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b).float()


def _unit(x: Tensor, heads_per_key: int) -> Tensor:
    """fp32 l2-normalised x [..., Hk, D] -> [..., Hv, D]: each key head serves `heads_per_key` value heads."""
    x = x.float()
    x = x * torch.rsqrt((x * x).sum(-1, keepdim=True) + _L2_EPS)
    return x.repeat_interleave(heads_per_key, dim=-2)


def gdn_qk(q: Tensor, k: Tensor, heads_per_key: int) -> tuple[Tensor, Tensor]:
    """fp32 (q_t, k_t) from raw q, k [..., Hk, Dk]: l2-normalised, q scaled by Dk^-0.5, as [..., Hv, Dk]."""
    return _unit(q, heads_per_key) * q.shape[-1] ** -0.5, _unit(k, heads_per_key)


def _step(stored: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor,
          heads_per_key: int) -> Tensor:
    """One token of [B] rows from the pool-dtype `stored` [B, Hv, Dk, Dv]: the fp32 state after it."""
    g, beta = gdn_gates(a, b, A_log, dt_bias)  # [B, Hv]
    k32 = _unit(k, heads_per_key)  # [B, Hv, Dk]
    state = stored.float() * torch.exp(g)[..., None, None]
    delta = (v.float() - (state * k32[..., None]).sum(-2)) * beta[..., None]  # [B, Hv, Dv]
    return state + k32[..., None] * delta[..., None, :]


def _read(state: Tensor, q: Tensor, heads_per_key: int) -> Tensor:
    """o = S^T q_t of [B] rows: fp32 state [B, Hv, Dk, Dv], raw q [B, Hk, Dk] -> [B, Hv, Dv] fp32."""
    q32 = _unit(q, heads_per_key) * q.shape[-1] ** -0.5
    return (state * q32[..., None]).sum(-2)


def _check_slots(fn: str, name: str, slots: Tensor, num_slots: int) -> None:
    values = slots.tolist()
    if any(s < 0 or s >= num_slots for s in values):
        raise ValueError(f"{fn}: {name} expected values in [0, {num_slots}), got {values}")
    # Two rows on one slot would both read the old state and one write would be lost.
    if len(set(values)) != len(values):
        raise ValueError(f"{fn}: {name} expected distinct slots, got {values}")


def gated_delta_decode(
    state: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    state_slots: Tensor,
) -> Tensor:
    """Advance each row's state by one token and return that token's output.

    state [S, Hv, Dk, Dv] pool, updated in place at `state_slots` only; q, k [B, Hk, Dk]; v [B, Hv, Dv]; a, b [B, Hv]
    raw; A_log, dt_bias [Hv]; state_slots [B] distinct. Returns o [B, Hv, Dv] in v.dtype.
    """
    fn = "gated_delta_decode"
    batch, Hk, Dk, Hv, Dv, S = check_decode_shapes(fn, state, q, k, v, a, b, A_log, dt_bias, state_slots)
    _check_slots(fn, "state_slots", state_slots, S)

    idx = state_slots.long()
    J = Hv // Hk
    new = _step(state[idx], k, v, a, b, A_log, dt_bias, J)  # [B, Hv, Dk, Dv] fp32
    state[idx] = new.to(state.dtype)
    # The output reads the fp32 state, as the chunked prefill does, not the pool's rounded copy.
    return _read(new, q, J).to(v.dtype)


def _chunk_row(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
               chunk_size: int) -> tuple[Tensor, Tensor]:
    """One row, fp32, HF's chunked form: q, k [L, Hv, Dk] normalised; v [L, Hv, Dv]; g, beta [L, Hv]; state
    [Hv, Dk, Dv]. Returns (o [L, Hv, Dv], final state)."""
    length, Hv, Dv = v.shape
    if length == 0:
        return v.new_zeros(0, Hv, Dv), state
    # A row that fits in one chunk is that one chunk; padding it to chunk_size would only add zeros.
    C = min(chunk_size, length)
    n = -(-length // C)
    pad = n * C - length

    # Padding tokens get k = v = 0, beta = 0 and g = 0: they leave the state as it is.
    def chunks(x: Tensor) -> Tensor:  # [L, Hv, ...] -> [Hv, n, C, ...]
        x = F.pad(x.transpose(0, 1), (0, 0) * (x.dim() - 2) + (0, pad))
        return x.reshape(Hv, n, C, *x.shape[2:])

    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = g.cumsum(-1)  # [Hv, n, C]: log decay from the chunk's start to position i, inclusive
    upper = torch.ones(C, C, dtype=torch.bool, device=v.device).triu(1)
    # decay[..., i, j]: from position j to position i of a chunk (0 when j > i).
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()  # [Hv, n, C, C]

    # The UT transform: the chunk's delta-rule writes, solved at once (unit lower triangle: the diagonal is 1).
    system = (k_beta @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)  # [Hv, n, C, Dv]
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay  # [Hv, n, C, C], causal
    q_from_start = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()  # [Hv, n]

    o = torch.empty(Hv, n, C, Dv, dtype=torch.float32, device=v.device)
    for c in range(n):
        # The part of each write that the chunk's start state already predicts is not written again.
        v_new = u[:, c] - w[:, c] @ state  # [Hv, C, Dv]
        o[:, c] = q_from_start[:, c] @ state + attn[:, c] @ v_new
        state = state * chunk_decay[:, c, None, None] + k_to_end[:, c].transpose(-1, -2) @ v_new
    return o.reshape(Hv, n * C, Dv)[:, :length].transpose(0, 1), state


def gated_delta_prefill_varlen(
    state: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    query_start_loc: Tensor,
    state_slots: Tensor,
    has_initial_state: Tensor,
    chunk_size: int,
) -> Tensor:
    """Run every prefill row of a varlen batch; write each row's final state into its pool slot.

    state [S, Hv, Dk, Dv] pool; q, k [T, Hk, Dk]; v [T, Hv, Dv]; a, b [T, Hv] raw; A_log, dt_bias [Hv];
    query_start_loc [R+1] (row r owns tokens query_start_loc[r]:query_start_loc[r+1]); state_slots [R] distinct;
    has_initial_state [R] bool (False: the row starts from zeros and its slot's old contents are never read).
    Returns o [T, Hv, Dv] in v.dtype.
    """
    fn = "gated_delta_prefill_varlen"
    T, Hk, Dk, Hv, Dv, S, R = check_prefill_shapes(fn, state, q, k, v, a, b, A_log, dt_bias, query_start_loc,
                                                   state_slots, has_initial_state, chunk_size)
    bounds = query_start_loc.tolist()
    if bounds[0] != 0 or bounds[-1] != T or any(x > y for x, y in zip(bounds, bounds[1:], strict=False)):
        raise ValueError(f"{fn}: query_start_loc expected non-decreasing from 0 to T = {T}, got {bounds}")
    _check_slots(fn, "state_slots", state_slots, S)

    slots, has_init = state_slots.tolist(), has_initial_state.tolist()
    q32, k32 = gdn_qk(q, k, Hv // Hk)  # [T, Hv, Dk]
    g, beta = gdn_gates(a, b, A_log, dt_bias)  # [T, Hv]
    v32 = v.float()
    o = torch.empty(T, Hv, Dv, dtype=torch.float32, device=v.device)
    for r in range(R):
        lo, hi = bounds[r], bounds[r + 1]
        if has_init[r]:
            init = state[slots[r]].float()
        else:
            init = torch.zeros(Hv, Dk, Dv, dtype=torch.float32, device=v.device)
        o[lo:hi], final = _chunk_row(q32[lo:hi], k32[lo:hi], v32[lo:hi], g[lo:hi], beta[lo:hi], init, chunk_size)
        state[slots[r]] = final.to(state.dtype)
    return o.to(v.dtype)


def gated_delta_verify(
    state: Tensor,
    pending_k: Tensor,
    pending_v: Tensor,
    pending_a: Tensor,
    pending_b: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    slots: Tensor,
    replay: Tensor,
    num_tokens: Tensor | None = None,
) -> Tensor:
    """Replay each row's `replay[b]` pending positions into its state, then run its T verify tokens.

    state [S, Hv, Dk, Dv] pool; pending_k [S, L, Hk, Dk], pending_v [S, L, Hv, Dv], pending_a, pending_b [S, L, Hv]
    with L >= T, the raw inputs of each slot's last verify; q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; a, b [B, T, Hv]
    raw; A_log, dt_bias [Hv]; slots [B] distinct; replay [B] in 0..L; num_tokens [B] in 1..T (None: all T). Writes
    state[slots] (the replayed state) and pending_*[slots, :T] (this step's inputs). Returns o [B, T, Hv, Dv] in
    v.dtype, zero past num_tokens.
    """
    fn = "gated_delta_verify"
    batch, T, Hk, Dk, Hv, Dv, L = check_verify_shapes(fn, state, pending_k, pending_v, pending_a, pending_b, q, k, v,
                                                      a, b, A_log, dt_bias, slots, replay, num_tokens)
    S = state.shape[0]
    num_tokens = default_num_tokens(num_tokens, batch, T, v.device)
    check_verify_indices(fn, slots, replay, num_tokens, S, L, T)

    J = Hv // Hk
    idx = slots.long()
    # Every step runs on [B, ...] tensors shaped exactly as one `gated_delta_decode` call, so that on CPU the
    # elementwise exp/softplus/rsqrt round as a decode step's do.
    stored = state[idx]  # [B, Hv, Dk, Dv], pool dtype
    for j in range(L):
        new = _step(stored, pending_k[idx, j], pending_v[idx, j], pending_a[idx, j], pending_b[idx, j], A_log,
                    dt_bias, J)
        stored = torch.where((j < replay)[:, None, None, None], new.to(state.dtype), stored)
    state[idx] = stored

    valid = torch.arange(T, device=v.device)[None, :] < num_tokens[:, None]  # [B, T]
    o = torch.zeros(batch, T, Hv, Dv, dtype=torch.float32, device=v.device)
    for t in range(T):
        new = _step(stored, k[:, t], v[:, t], a[:, t], b[:, t], A_log, dt_bias, J)
        # The next position reads what the pool would hold, as a decode step (and a later replay) does.
        stored = new.to(state.dtype)
        # The output reads the fp32 state, as the single-token op does, not the pool's rounded copy.
        o[:, t] = torch.where(valid[:, t, None, None], _read(new, q[:, t], J), 0.0)
    # This step's inputs are the next step's pending ones (read above, before this write).
    pending_k[idx, :T] = k.to(pending_k.dtype)
    pending_v[idx, :T] = v.to(pending_v.dtype)
    pending_a[idx, :T] = a.to(pending_a.dtype)
    pending_b[idx, :T] = b.to(pending_b.dtype)
    return o.to(v.dtype)
