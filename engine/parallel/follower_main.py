"""`python -m baton.engine.parallel.follower_main`: one of ranks 1..N-1 of a node (`rank_processes` starts it).

It builds its engine over the group with the config rank 0 was given, then replays rank 0's calls until told to
stop (`follower.follow`); it exits 0 then, and non-zero (its traceback above) on any error, which ends the node.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import os
import signal
import sys

import torch
import torch.distributed as dist

from baton.engine.engine_config import EngineConfig
from baton.engine.llm_engine import LLMEngine, resolved_device
from baton.engine.loader import load_checkpoint
from baton.engine.parallel.command_channel import CommandChannel
from baton.engine.parallel.follower import Applied, follow
from baton.engine.parallel.group import TPGroup
from baton.engine.tokenizer import load_tokenizer

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel kill this process when rank 0 (its parent) dies, however it dies; exit now if it already
    has."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        sys.exit(f"tensor-parallel rank: rank 0 (pid {parent_pid}) exited before this rank started")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="baton-tp-rank")
    p.add_argument("--model", required=True)
    p.add_argument("--config", required=True, help="the EngineConfig's fields as JSON")
    p.add_argument("--init-method", required=True)
    p.add_argument("--parent-pid", type=int, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--attach", default="", help="module:function called with (engine, rank, attach_arg, applied) "
                   "once the engine is built, before the rank follows rank 0: the node's own per-rank services")
    p.add_argument("--attach-arg", default="")
    a = p.parse_args(argv)
    die_with_parent(a.parent_pid)
    config = EngineConfig(**json.loads(a.config))
    tp = config.tensor_parallel_size
    device = resolved_device(config.device)
    if device.type == "cpu":  # the ranks share this machine's cores
        torch.set_num_threads(max(1, torch.get_num_threads() // tp))
    model_cfg, weights = load_checkpoint(a.model, None if config.dtype == "auto" else config.dtype)
    group = TPGroup.init(tp, a.rank, device, a.init_method)
    channel = CommandChannel(group)
    engine = LLMEngine(model_cfg, weights, config, tp=group)
    del weights
    # Every rank masks its rows' logits alike: each holds the grammars' matchers.
    if (tokenizer := load_tokenizer(a.model)) is not None:
        engine.use_tokenizer(tokenizer)
    applied = Applied()
    if a.attach:
        module, _, function = a.attach.partition(":")
        # Named, not imported: the engine does not depend on the serving packages that attach here.
        getattr(importlib.import_module(module), function)(engine, a.rank, a.attach_arg, applied)
    follow(engine, channel, applied)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
