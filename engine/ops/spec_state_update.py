"""Speculative-verify state updates for Mamba2 layers, by replay (torch references).

A verify row feeds T = 1+k tokens: the last accepted token and k drafts. Which of them the target accepts
is only known after the forward, and the next step must resume from the state after the last accepted one
(DESIGN.md R3/R4). Writing the full state after every position (1+K states per row) would make the
verify step's state traffic grow with K. Instead each request's slot keeps, beside its committed state, the
few per-position INPUTS of its last verify (`pending`, K+1 positions): conv inputs, and the SSM's x, B and
raw dt. The next step first replays the `replay[b]` accepted positions (1 + accepted drafts, decided on the
device by the rejection sampler) into the committed state, stores it once, then runs its own T tokens from
there without storing any per-position state, and finally records its own inputs as the new pending ones.
Per verify step a row's state is read once and written once, whatever K is.

Each replayed position reads the state as the pool would hold it (rounded to the pool dtype) and stores it
rounded again, exactly as a plain decode step would: the committed state after replaying a+1 positions is
bit-for-bit the non-speculative decode over the same tokens, in every dtype (on CPU, given the same batch
rows: a vectorized exp/silu may round an element differently by its place in the tensor).

Rows may be shorter than T (`num_tokens[b]` in 1..T): y past num_tokens[b] is zero; the pending inputs of
every position up to T are recorded (the rejection sampler never accepts past num_tokens[b]).

Slot contract (a GPU kernel runs rows in parallel): `slots` are distinct values in [0, S); `replay[b]` in
0..L where L >= T is the pending length.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from baton.engine.ops.checks import check_shape
from baton.engine.ops.selective_state_update import discretize_dt


def check_verify_indices(fn: str, slots: Tensor, replay: Tensor, num_tokens: Tensor, num_slots: int,
                         pending_len: int, T: int) -> None:
    """Host checks of the slot contract above (the Triton kernels skip them: they would sync)."""
    counts = num_tokens.tolist()
    if any(n < 1 or n > T for n in counts):
        raise ValueError(f"{fn}: num_tokens expected values in [1, {T}], got {counts}")
    s = slots.tolist()
    if any(v < 0 or v >= num_slots for v in s):
        raise ValueError(f"{fn}: slots expected values in [0, {num_slots}), got {s}")
    # Two rows on one slot would race for the same state and pending inputs.
    if len(set(s)) != len(s):
        raise ValueError(f"{fn}: slots expected distinct slots, got {s}")
    r = replay.tolist()
    if any(v < 0 or v > pending_len for v in r):
        raise ValueError(f"{fn}: replay expected values in [0, {pending_len}], got {r}")


def _default_num_tokens(num_tokens: Tensor | None, batch: int, T: int, device: torch.device) -> Tensor:
    if num_tokens is None:
        return torch.full((batch,), T, dtype=torch.int64, device=device)
    return num_tokens


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
    num_tokens = _default_num_tokens(num_tokens, batch, T, x.device)
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
    num_tokens = _default_num_tokens(num_tokens, batch, T, x.device)
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
