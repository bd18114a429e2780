"""Rank 0's commands to the other ranks: a batch of `commands.Command`s broadcast over a gloo group of its own.

Its own group, on the CPU whatever the model's backend: under NCCL the commands stay off the GPU's stream, and a
rank waiting for its next command while the node is idle does not hold up any collective of the model's. The
group's timeout is long because an idle node sends nothing for as long as it is idle; a rank that died is noticed
by its peers' sockets closing (and by rank 0's process watch), not by this timeout.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from baton.engine.parallel.commands import Command
from baton.engine.parallel.group import TPGroup

IDLE_TIMEOUT = timedelta(days=365)


class CommandChannel:
    def __init__(self, tp: TPGroup) -> None:
        """Every rank of `tp` creates its channel at the same point (it creates a process group)."""
        self.tp = tp
        self.group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)

    def send(self, commands: list[Command]) -> None:
        """Rank 0: hand `commands` (in order) to every other rank."""
        if self.tp.rank != 0:
            raise ValueError(f"command channel: expected rank 0 to send, got rank {self.tp.rank}")
        dist.broadcast_object_list([commands], src=0, group=self.group)

    def receive(self) -> list[Command]:
        """Another rank: the next batch rank 0 sent (waits for it)."""
        box: list[object] = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        commands = box[0]
        if not isinstance(commands, list):
            raise ValueError(f"command channel: expected a list of commands from rank 0, got {commands!r}")
        return commands
