"""The engine calls that change an engine's state, as typed messages: rank 0 records each call it made, and the
other ranks replay them in the same order (`follower.follow`), so that every rank's scheduler holds the same
requests, blocks and slots and schedules the same step.

Invariant: a command is recorded only once rank 0's own call returned (a call that raised changed nothing and is
not replayed), and `apply` calls the same method with the same arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

from baton.engine.llm_engine import LLMEngine
from baton.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class AddRequest:
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    request_id: str  # rank 0's id, given or made: the other ranks take it as given
    prefill_only: bool


@dataclass(frozen=True)
class AddComputedRequest:
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    request_id: str
    block_ids: tuple[int, ...]
    state_slot: int
    num_computed: int


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class FreeHeld:
    block_ids: tuple[int, ...]
    state_slot: int


@dataclass(frozen=True)
class Reserve:
    num_tokens: int


@dataclass(frozen=True)
class CaptureGraphs:
    sampled_verify: bool


@dataclass(frozen=True)
class Step:
    """One `step()`; `check`: rank 0's `step_check` just before it, which every rank's must equal."""
    check: tuple[int, ...]


@dataclass(frozen=True)
class Stop:
    """The ranks leave their loop (rank 0 is shutting down)."""


Command = AddRequest | AddComputedRequest | Abort | FreeHeld | Reserve | CaptureGraphs | Step | Stop


def step_check(engine: LLMEngine) -> tuple[int, ...]:
    """Counts that differ between two ranks whose schedulers drifted apart (requests waiting and running, free
    blocks and slots, steps so far): cheap to compare before every step, so that a rank that diverged stops with
    an error instead of running collectives that do not match."""
    s = engine.scheduler
    return len(s.waiting), len(s.running), s.cache.blocks.num_free, s.cache.slots.num_free, engine.stats.steps


def apply(engine: LLMEngine, cmd: Command) -> None:
    """Make on `engine` the call `cmd` records (its result, the same as rank 0's, is not needed here)."""
    match cmd:
        case AddRequest():
            engine.add_request(list(cmd.prompt_token_ids), cmd.params, cmd.request_id, cmd.prefill_only)
        case AddComputedRequest():
            engine.add_computed_request(list(cmd.prompt_token_ids), cmd.params, cmd.request_id,
                                        list(cmd.block_ids), cmd.state_slot, cmd.num_computed)
        case Abort():
            engine.abort(cmd.request_id)
        case FreeHeld():
            engine.free_held(cmd.block_ids, cmd.state_slot)
        case Reserve():
            engine.reserve(cmd.num_tokens)
        case CaptureGraphs():
            engine.capture_graphs(cmd.sampled_verify)
        case Step():
            engine.step()
        case _:
            raise ValueError(f"tensor parallel command: expected one of {Command}, got {cmd!r}")
