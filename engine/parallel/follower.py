"""Ranks 1..N-1 of a node: replay rank 0's calls on this rank's engine until rank 0 says stop (`leader`)."""

from __future__ import annotations

from baton.engine.llm_engine import LLMEngine
from baton.engine.parallel.command_channel import CommandChannel
from baton.engine.parallel.commands import Step, Stop, apply, step_check


def follow(engine: LLMEngine, channel: CommandChannel) -> None:
    """Apply every command rank 0 sends, in order; returns on `Stop`. A step whose `step_check` differs from rank
    0's raises: this rank's scheduler drifted from rank 0's, and its collectives would not match."""
    while True:
        for cmd in channel.receive():
            if isinstance(cmd, Stop):
                return
            if isinstance(cmd, Step) and (mine := step_check(engine)) != cmd.check:
                raise RuntimeError(f"tensor-parallel rank {engine.tp.rank}: expected rank 0's state before step "
                                   f"{cmd.check[-1]} (waiting, running, free blocks, free slots, steps) "
                                   f"{cmd.check}, got {mine}")
            apply(engine, cmd)
