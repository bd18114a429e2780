"""Speculative-verify state updates for Mamba2 layers, by replay: the scheme and the host checks that the conv and
SSM verify references (`conv.reference`, `ssm_update.reference`) share.

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
from torch import Tensor


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


def default_num_tokens(num_tokens: Tensor | None, batch: int, T: int, device: torch.device) -> Tensor:
    if num_tokens is None:
        return torch.full((batch,), T, dtype=torch.int64, device=device)
    return num_tokens
