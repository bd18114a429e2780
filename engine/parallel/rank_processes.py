"""The node's tensor-parallel ranks as processes: rank 0 is the calling process (it serves and drives the
engine, `leader`), ranks 1..N-1 are children it starts (`follower_main`), each building its engine over the same
group and replaying rank 0's calls.

Invariants: a config that cannot be split is refused before any process starts; a rank that exits while the node
runs ends the node at once with an error naming it (no rank can serve without the others' shards), killing the
other ranks first; rank 0's own end ends them (told to stop on a clean shutdown, killed by the kernel if rank 0
dies: `follower_main.die_with_parent`). The children run in a process group of their own, so that a signal meant
for the node (Ctrl-C, `kill -TERM -PGID`) reaches rank 0 only, which drains before it stops them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

from baton.engine.engine_config import EngineConfig
from baton.engine.llm_engine import LLMEngine, resolved_device
from baton.engine.loader import load_checkpoint, read_model_config
from baton.engine.parallel.command_channel import CommandChannel
from baton.engine.parallel.group import TPGroup
from baton.engine.parallel.leader import LeaderEngine
from baton.engine.parallel.shard_config import shard_config
from baton.engine.tokenizer import load_tokenizer

# A node whose rank died exits with this code (after the one line saying which).
RANK_DIED_EXIT = 3
# How long the ranks get to leave their loop once told to stop, before they are killed.
STOP_TIMEOUT_S = 10.0


def check_devices(config: EngineConfig) -> None:
    """Every rank needs a device of its own: on CUDA rank r takes visible GPU r, so the device must name none."""
    tp = config.tensor_parallel_size
    device = resolved_device(config.device)
    if device.type != "cuda":
        return
    if device.index is not None:
        raise ValueError(f"engine field 'device': expected 'cuda' or 'auto' with tensor_parallel_size={tp} (rank r "
                         f"computes on visible GPU r), got {config.device!r}")
    if torch.cuda.device_count() < tp:
        raise ValueError(f"engine field 'tensor_parallel_size': expected at most the {torch.cuda.device_count()} "
                         f"visible GPUs (one per rank), got {tp}")


class RankProcesses:
    """Ranks 1..N-1 of this node, and the thread that watches them."""

    def __init__(self, model_dir: str, config: EngineConfig, attach: tuple[str, str] | None = None) -> None:
        """`attach`: (module:function, argument) each rank calls once its engine is built (`follower_main`)."""
        self.tp = config.tensor_parallel_size
        self._dir = tempfile.mkdtemp(prefix="baton-tp-")
        self.init_method = f"file://{Path(self._dir) / 'rendezvous'}"
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        args = ["--model", str(model_dir), "--config", json.dumps(dataclasses.asdict(config)),
                "--init-method", self.init_method, "--parent-pid", str(os.getpid())]
        if attach is not None:
            args += ["--attach", attach[0], "--attach-arg", attach[1]]
        self.procs = {r: subprocess.Popen([sys.executable, "-m", "baton.engine.parallel.follower_main", *args,
                                           "--rank", str(r)], process_group=0)
                      for r in range(1, self.tp)}
        for r, proc in self.procs.items():
            threading.Thread(target=self._watch, args=(r, proc), name=f"baton-tp-watch-{r}", daemon=True).start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values()]

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        with self._lock:  # the first death is the news; the ranks killed below are not
            if self._stopping.is_set():
                return
            self._stopping.set()
        print(f"error: tensor-parallel rank {rank} of {self.tp} (pid {proc.pid}) exited with code {code}; stopping "
              f"the node (each rank holds a shard of every layer, so none can serve without it)",
              file=sys.stderr, flush=True)
        self._kill()
        shutil.rmtree(self._dir, ignore_errors=True)
        os._exit(RANK_DIED_EXIT)

    def _kill(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            proc.wait()

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Wait for the ranks to leave (they were told to stop), killing those still there after `timeout`."""
        with self._lock:
            self._stopping.set()
        for proc in self.procs.values():
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                break
        self._kill()
        shutil.rmtree(self._dir, ignore_errors=True)


def start_engine(model_dir: str | Path, config: EngineConfig, attach: tuple[str, str] | None = None) -> LLMEngine:
    """The engine of a node or command: at one rank an `LLMEngine`; with `tensor_parallel_size` N > 1 rank 0's
    `LeaderEngine`, ranks 1..N-1 started as processes (`close()` stops them). A config or device set that cannot
    be split raises ValueError naming the field before any process starts. Call it on the main thread: the
    kernel's parent-death signal follows the thread that started the ranks, not the process. `attach`: what ranks
    1..N-1 start beside their engine (`follower_main --attach`)."""
    tp = config.tensor_parallel_size
    if tp == 1:
        return LLMEngine.from_pretrained(model_dir, config)
    shard_config(read_model_config(model_dir), tp)
    check_devices(config)
    device = resolved_device(config.device)
    if device.type == "cpu":  # the ranks share this machine's cores
        torch.set_num_threads(max(1, torch.get_num_threads() // tp))
    # The other ranks start (import torch, load the checkpoint) while this one loads it.
    ranks = RankProcesses(str(model_dir), config, attach)
    try:
        model_cfg, weights = load_checkpoint(model_dir, None if config.dtype == "auto" else config.dtype)
        group = TPGroup.init(tp, 0, device, ranks.init_method)
        engine = LeaderEngine(model_cfg, weights, config, group, CommandChannel(group))
    except BaseException:
        ranks.stop(0)
        raise
    del weights
    if (tokenizer := load_tokenizer(model_dir)) is not None:
        engine.use_tokenizer(tokenizer)
    engine.on_close.append(ranks.stop)
    engine.rank_pids = ranks.pids
    print(f"tensor parallel: {tp} ranks, rank 0 here (pid {os.getpid()}), ranks 1..{tp - 1} pids "
          f"{' '.join(map(str, ranks.pids))}", flush=True)
    return engine
