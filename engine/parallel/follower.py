"""Ranks 1..N-1 of a node: replay rank 0's calls on this rank's engine until rank 0 says stop (`leader`)."""

from __future__ import annotations

import threading

from baton.engine.llm_engine import LLMEngine
from baton.engine.parallel.command_channel import CommandChannel
from baton.engine.parallel.commands import Step, Stop, apply, step_check


class Applied:
    """How many of rank 0's commands this rank has applied: another thread of the rank (a transfer into blocks
    rank 0 reserved) waits here until the command that reserved them is applied, so that no step of this rank
    still uses them for the request that held them before."""

    def __init__(self) -> None:
        self.count = 0
        self._cond = threading.Condition()

    def advance(self) -> None:
        with self._cond:
            self.count += 1
            self._cond.notify_all()

    def wait_for(self, count: int, timeout: float) -> bool:
        """True once `count` commands are applied; False if `timeout` seconds pass first."""
        with self._cond:
            return self._cond.wait_for(lambda: self.count >= count, timeout)


def follow(engine: LLMEngine, channel: CommandChannel, applied: Applied | None = None) -> None:
    """Apply every command rank 0 sends, in order; returns on `Stop`. A step whose `step_check` differs from rank
    0's raises: this rank's scheduler drifted from rank 0's, and its collectives would not match. `applied` counts
    the commands as they are applied (rank 0 counts them as it sends them: `LeaderEngine.commands_sent`)."""
    while True:
        for cmd in channel.receive():
            if isinstance(cmd, Stop):
                return
            if isinstance(cmd, Step) and (mine := step_check(engine)) != cmd.check:
                raise RuntimeError(f"tensor-parallel rank {engine.tp.rank}: expected rank 0's state before step "
                                   f"{cmd.check[-1]} (waiting, running, free blocks, free slots, steps) "
                                   f"{cmd.check}, got {mine}")
            apply(engine, cmd)
            if applied is not None:
                applied.advance()
