"""One step's plan as the scheduler gives it to the runner: rows of ints, decode rows first.

Invariants: immutable once built; every row belongs to a distinct running request; `rows` holds the decode rows
(in arrival order) before the prefill rows; block ids and slots are the request's own after this step's allocation.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property


@dataclass(frozen=True)
class ScheduledRow:
    request_id: str
    token_ids: tuple[int, ...]    # the tokens fed this step (query)
    num_computed_tokens: int      # context already in the caches before this step
    is_decode: bool               # decode phase (state-update path); False: a prefill chunk
    has_initial_state: bool       # False: the Mamba state starts from zeros, the slot is never read
    state_slot: int
    block_ids: tuple[int, ...]    # the request's whole block table after this step's allocation
    sample: bool                  # this step completes the known tokens: sample the next one
    # Decode rows: token_ids = the last token, then num_draft drafts to verify.
    num_draft: int = 0
    # The known token after this row's last one (a chunk's successor in the prompt), else -1: the MTP
    # drafter reads (h_i, t_{i+1}) at every position.
    next_token: int = -1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def new_row(**fields: object) -> ScheduledRow:
    """ScheduledRow(**fields) given every field, at a third of the cost: a frozen dataclass's __init__ sets each
    field through object.__setattr__, and a decode step builds one row per running request. The instance is
    the same (fields, equality, hash, repr, immutability)."""
    row = object.__new__(ScheduledRow)
    row.__dict__.update(fields)
    return row


@dataclass(frozen=True)
class CheckpointRow:
    """A prefix checkpoint taken inside a prefill chunk (`prefix_cache.py`): the recurrent mixers run the chunk's
    first `num_tokens` tokens once more as a sequence of their own, from the row's initial state copied into the
    lent state slot `slot`, which so ends up holding the state after them; `SchedulerOutput.checkpoints` copies it
    into the checkpoint slot after the step."""
    request_id: str  # a prefill row of the step
    num_tokens: int  # 0 < num_tokens < the row's tokens
    slot: int        # lent for the step (`CacheManager.lend_slot`)


@dataclass(frozen=True)
class SchedulerOutput:
    rows: tuple[ScheduledRow, ...]  # decode rows first, then prefill rows
    preempted: tuple[str, ...]
    # Prefix cache (`prefix_cache.py`): (checkpoint slot, state slot) pairs to copy before the forward (a request
    # resuming from a cached prefix), and (state slot, checkpoint slot) pairs to copy after it (a chunk ended on a
    # checkpoint boundary).
    restores: tuple[tuple[int, int], ...] = ()
    checkpoints: tuple[tuple[int, int], ...] = ()
    checkpoint_rows: tuple[CheckpointRow, ...] = ()

    # Cached (the output is immutable): the runner and the engine's stats read these several times a step.
    @cached_property
    def num_decodes(self) -> int:
        return sum(r.is_decode for r in self.rows)

    @property
    def num_prefills(self) -> int:
        return len(self.rows) - self.num_decodes

    @cached_property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.rows)

    @cached_property
    def token_starts(self) -> list[int]:
        """Where each row's tokens start in the step's flat token list, then the total: query_start_loc as ints
        (row i's last token is token_starts[i + 1] - 1). Shared, not to be modified."""
        starts = [0]
        for r in self.rows:
            starts.append(starts[-1] + len(r.token_ids))
        return starts

    @property
    def is_mixed(self) -> bool:
        return 0 < self.num_decodes < len(self.rows)


def with_checkpoint_row(out: SchedulerOutput, slot: int) -> SchedulerOutput:
    """`out`, a step of one prefill row, with a checkpoint row of all its tokens but one into state slot `slot`: the
    most extra mixer work a step of that chunk carries (the engine's memory probe)."""
    if len(out.rows) != 1 or out.rows[0].is_decode or out.rows[0].num_tokens < 2:
        raise ValueError(f"with_checkpoint_row: expected one prefill row of at least 2 tokens, got "
                         f"{[(r.num_tokens, r.is_decode) for r in out.rows]}")
    row = out.rows[0]
    return replace(out, checkpoint_rows=(CheckpointRow(row.request_id, row.num_tokens - 1, slot),))
