"""A request's bookkeeping as the scheduler sees it: token ids, progress and owned cache ids (ints only)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from baton.engine.sampling_params import SamplingParams
from baton.engine.token_logprob import TokenLogprob

# An output token that a launched step samples but whose value is not read yet (async scheduling): it holds its
# place in `output_token_ids` until `StepUpdate.resolve` writes the value. Token ids are >= 0.
PENDING = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    # A prefill-only request whose tokens are all computed: its blocks and slot are handed to the caller
    # (the prefill node leases them to a decode node) instead of being freed.
    FINISHED_PREFILLED = "prefilled"

    @property
    def finished(self) -> bool:
        # A module tuple: looking the members up on the enum class costs more than the test (read every step).
        return self not in _UNFINISHED


_UNFINISHED = (RequestStatus.WAITING, RequestStatus.RUNNING)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: tuple[int, ...] | list[int]  # the engine keeps a tuple: outputs share it without a copy
    sampling: SamplingParams
    # Admission order (FCFS); preempted requests keep theirs and go back to the front.
    arrival: int
    # Stop ids: the model's EOS ids (unless ignore_eos) plus the request's own stop ids.
    stop_ids: frozenset[int] = frozenset()
    max_model_len: int = 1 << 30
    # Compute the KV and state of all prompt tokens but the last (R1), never sample, and hand the caches
    # over when done (prefill node). The last token is kept as the successor the MTP drafter reads (R8).
    prefill_only: bool = False
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    # Tokens whose KV / state effect is in the caches.
    num_computed_tokens: int = 0
    # Tokens to prefill since the last (re)admission: the prompt, or prompt + outputs after preemption.
    num_prefill_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    # The request's state slot in the pools (conv + SSM state, and its recorded verify inputs).
    state_slot: int | None = None
    num_preemptions: int = 0
    # Speculative decoding: the drafts proposed for the next step (verified then), and totals.
    draft_token_ids: list[int] = field(default_factory=list)
    num_drafted: int = 0    # draft tokens verified
    num_accepted: int = 0   # of those, accepted
    num_verify_steps: int = 0
    # The prefix cache's hashes of this request's first full blocks (`PrefixCache.hashes`), computed once each.
    block_hashes: list[bytes] = field(default_factory=list, repr=False)
    # The key of the last prefix checkpoint this request took (`PrefixCache.take`), None before its first.
    last_checkpoint: tuple[bytes, int] | None = field(default=None, repr=False)
    # The key of the checkpoint its admission's prefix hit resumed from (`PrefixCache.use`), until it takes one.
    hit_checkpoint: tuple[bytes, int] | None = field(default=None, repr=False)
    # SamplingParams.logprobs: output index -> its logprobs, until an output carries them.
    logprobs: dict[int, TokenLogprob] = field(default_factory=dict)
    # SamplingParams.prompt_logprobs: one per prompt token (None for the first, and until scored); None: not asked.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_sent: bool = False
    # `block_ids` as a tuple, built once per change rather than once per step (a decode row's table changes
    # only every block_size tokens). Only the cache manager changes `block_ids`, through the methods below.
    _block_table: tuple[int, ...] | None = field(default=None, init=False, repr=False)

    def block_table(self) -> tuple[int, ...]:
        """The block ids as a tuple, shared by every step until they change."""
        table = self._block_table
        # The length check also catches an append that bypassed `add_blocks` (the list only grows or is replaced).
        if table is None or len(table) != len(self.block_ids):
            table = self._block_table = tuple(self.block_ids)
        return table

    def add_blocks(self, ids: list[int]) -> None:
        if ids:
            self.block_ids.extend(ids)
            self._block_table = None

    def set_blocks(self, ids: list[int]) -> None:
        self.block_ids = ids
        self._block_table = None

    def resolved_output_ids(self) -> tuple[int, ...]:
        """The output tokens whose values are known: all but the trailing PENDING ones (steps in flight)."""
        out = self.output_token_ids
        n = len(out)
        while n and out[n - 1] == PENDING:
            n -= 1
        return tuple(out[:n])

    @property
    def all_token_ids(self) -> list[int]:
        return [*self.prompt_token_ids, *self.output_token_ids]

    @property
    def last_token_id(self) -> int:
        """The newest token (O(1): a decode step of a long request must not copy its whole sequence)."""
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """Tokens start..end-1 of prompt + outputs, copying only those."""
        p = len(self.prompt_token_ids)
        return [*self.prompt_token_ids[start:end], *self.output_token_ids[max(start - p, 0):max(end - p, 0)]]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def in_decode(self) -> bool:
        """True once the (re)admitted prefill is fully computed: the request holds a state and a KV prefix.

        The Mamba path is chosen by this, never by the query length (R2): a new 1-token prompt is a prefill.
        """
        return self.status is RequestStatus.RUNNING and self.num_computed_tokens >= self.num_prefill_tokens > 0

    @property
    def output_limit(self) -> int:
        """The most output tokens this request may have: max_tokens, and max_model_len counting the prompt."""
        return min(self.sampling.max_tokens, self.max_model_len - len(self.prompt_token_ids))

    @property
    def has_initial_state(self) -> bool:
        return self.num_computed_tokens > 0

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None
