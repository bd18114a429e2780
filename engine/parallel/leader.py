"""Rank 0's engine in a node of several tensor-parallel ranks: an `LLMEngine` whose state-changing calls are
recorded as `commands` and sent to the other ranks with the next step, which they replay before it
(`follower.follow`).

Only rank 0 takes requests and hands out outputs; the others hold their shards and run the same steps. Sending
the calls, not each step's schedule, keeps every rank's scheduler, caches and runner state the same without a
second way of launching a step; each step carries rank 0's `step_check`, so that a rank that drifted stops with an
error. Sampling and verify decisions are rank 0's already (broadcast in the runner), so every rank's requests
advance alike.

Invariant: calls are made on one thread (the engine thread), and the commands reach the other ranks in the order
rank 0 made them, every one before the step that follows it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from baton.engine.config import ModelConfig
from baton.engine.engine_config import EngineConfig
from baton.engine.llm_engine import LLMEngine, RequestOutput
from baton.engine.parallel.command_channel import CommandChannel
from baton.engine.parallel.commands import (
    Abort,
    AddComputedRequest,
    AddRequest,
    CaptureGraphs,
    Command,
    FreeHeld,
    Reserve,
    Step,
    Stop,
    step_check,
)
from baton.engine.parallel.group import TPGroup
from baton.engine.sampling_params import SamplingParams


class LeaderEngine(LLMEngine):
    def __init__(self, model_cfg: ModelConfig, weights: dict[str, torch.Tensor], config: EngineConfig,
                 tp: TPGroup, channel: CommandChannel) -> None:
        if tp.rank != 0:
            raise ValueError(f"leader engine: expected tensor-parallel rank 0, got rank {tp.rank}")
        super().__init__(model_cfg, weights, config, tp)
        self.channel = channel
        self._queued: list[Command] = []
        # Called by `close` once the other ranks were told to stop (the node's processes: `rank_processes`).
        self.on_close: list[Callable[[], None]] = []
        # The other ranks' process ids (where this process started them).
        self.rank_pids: list[int] = []
        self._closed = False
        # Commands sent to the other ranks so far (each rank counts those it applied: `follower.Applied`).
        self.commands_sent = 0

    def _flush(self) -> None:
        commands, self._queued = self._queued, []
        self.channel.send(commands)
        self.commands_sent += len(commands)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    prefill_only: bool = False) -> str:
        rid = super().add_request(prompt_token_ids, params, request_id, prefill_only)
        self._queued.append(AddRequest(tuple(prompt_token_ids), params, rid, prefill_only))
        return rid

    def add_computed_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                             block_ids: list[int], state_slot: int, num_computed: int) -> str:
        rid = super().add_computed_request(prompt_token_ids, params, request_id, block_ids, state_slot, num_computed)
        self._queued.append(AddComputedRequest(tuple(prompt_token_ids), params, rid, tuple(block_ids), state_slot,
                                               num_computed))
        return rid

    def abort(self, request_id: str) -> bool:
        found = super().abort(request_id)
        self._queued.append(Abort(request_id))
        return found

    def free_held(self, block_ids: tuple[int, ...] | list[int], state_slot: int) -> None:
        super().free_held(block_ids, state_slot)
        self._queued.append(FreeHeld(tuple(block_ids), state_slot))

    def reserve(self, num_tokens: int) -> tuple[list[int], int] | None:
        got = super().reserve(num_tokens)
        if got is not None:  # a reservation that found no room changed nothing
            self._queued.append(Reserve(num_tokens))
        return got

    def reserve_for(self, prompt_token_ids: list[int], num_tokens: int) -> tuple[list[int], int, int] | None:
        # (No held prefix: the other ranks replay `Reserve`, which allocates every block.)
        got = self.reserve(num_tokens)
        if got is None:
            return None
        # Now, not with the next step: every rank reads its shard into these blocks once it has reserved them too
        # (`commands_sent`), and an idle node takes no step.
        self._flush()
        return (*got, 0)

    def capture_graphs(self, sampled_verify: bool = True) -> int:
        # Now, not with the next step: a capture runs the model's collectives, which every rank must join.
        self._queued.append(CaptureGraphs(sampled_verify))
        self._flush()
        return super().capture_graphs(sampled_verify)

    def step(self) -> list[RequestOutput]:
        self._queued.append(Step(step_check(self)))
        self._flush()
        return super().step()

    def close(self) -> None:
        """Tell the other ranks to leave their loop, then run `on_close` (once)."""
        if self._closed:
            return
        self._closed = True
        self._queued.append(Stop())
        try:
            self._flush()
        finally:
            for fn in self.on_close:
                fn()
