"""Tensor-parallel nodes (issue #50) with real processes on CPU (gloo): a decode node started with
`--tensor-parallel-size 2` serves through the router (aggregated: it prefills itself) the greedy and the seeded
sampled tokens of one rank, its Load counts the node once, SIGTERM drains it and stops both ranks; killing rank 1 ends the node with an
error naming the rank and leaves no process behind, as does killing rank 0; a config that cannot be split is refused at start naming the
field, before any rank starts, on either role. The offline
engine at two ranks gives one rank's tokens too, and a rank whose scheduler drifted from rank 0's stops the
ranks with an error instead of running collectives that do not match.

Each node start spawns a second torch process, the larger part of the time on a 2-core box: the serving, load and
SIGTERM checks share one node.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from baton.cli.cluster import Cluster
from baton.client import AsyncClient
from baton.engine.engine_config import EngineConfig
from baton.engine.llm_engine import LLMEngine
from baton.engine.make_model import make_model
from baton.engine.parallel.rank_processes import RANK_DIED_EXIT, RankProcesses
from baton.engine.sampling_params import SamplingParams
from baton.node.transfer_listen import UCX_NET_DEVICES
from tests.node_faults import all_free

ENGINE = {"block_size": 8, "max_num_batched_tokens": 32, "max_num_seqs": 4, "num_kv_blocks": 128}
ENGINE_ARGS = (*(x for k, v in ENGINE.items() for x in ("--" + k.replace("_", "-"), str(v))), "--device", "cpu")
TP2 = ("--tensor-parallel-size", "2")
MAX_TOKENS = 8
PROMPTS = [[(7 * i + n) % 500 + 3 for i in range(n)] for n in (1, 2, 9, 33, 70)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_model(tmp_path_factory.mktemp("tp-serving") / "tiny", preset="tiny", seed=5, progress=False,
                          tokenizer=False))


# Seeded sampling: rank 0 samples and every rank takes its tokens, so that two ranks draw what one does.
SAMPLED = {"temperature": 1.0, "top_k": 50, "seed": 11}


@pytest.fixture(scope="module")
def one_rank(model):
    """One rank's tokens for PROMPTS: greedy, and sampled with SAMPLED."""
    engine = LLMEngine.from_pretrained(model, EngineConfig(**ENGINE, device="cpu"))
    return {name: [list(o.token_ids) for o in engine.generate(PROMPTS, SamplingParams(
        max_tokens=MAX_TOKENS, ignore_eos=True, **kw))] for name, kw in (("greedy", {}), ("sampled", SAMPLED))}


@pytest.fixture(scope="module")
def reference(one_rank):
    return one_rank["greedy"]


def rank_pids(log: Path) -> list[int]:
    """Ranks 1..N-1's process ids, from the node's start line."""
    m = re.search(r"ranks 1\.\.\d+ pids ([\d ]+)", log.read_text())
    assert m, log.read_text()
    return [int(p) for p in m.group(1).split()]


def gone(pid: int, timeout: float = 10.0) -> bool:
    """Whether process `pid` has exited (and was reaped: no zombie left either) within `timeout`."""
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/{pid}"):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_tp2_node_serves_one_ranks_tokens_counts_once_and_stops_every_rank_on_sigterm(model, one_rank, tmp_path):
    logs = tmp_path / "logs"
    cluster = Cluster(model, prefill_workers=0, decode_workers=1, engine_args=(*ENGINE_ARGS, *TP2),
                      log_dir=str(logs))
    with cluster:
        pids = rank_pids(logs / "decode-0.log")

        async def main(**kw):
            async with AsyncClient(cluster.router_addr) as client:
                return await asyncio.gather(*(client.generate(p, max_tokens=MAX_TOKENS, ignore_eos=True, **kw)
                                              for p in PROMPTS))

        for name, kw in (("greedy", {}), ("sampled", SAMPLED)):
            assert [list(o.token_ids) for o in asyncio.run(main(**kw))] == one_rank[name], name
        free, loads = all_free(cluster)
        assert free, loads
        # The router sees one worker, and its slots are one rank's (every rank holds the same slots).
        assert len(loads) == 1 and loads[0].total_state_slots == ENGINE["max_num_seqs"]
        node = cluster.procs["decode-0"]
        cluster.stop()
        assert node.returncode == 0, (logs / "decode-0.log").read_text()
        assert all(gone(p) for p in pids)


def test_killing_rank_1_ends_the_node_with_an_error_and_leaves_no_process(model, tmp_path):
    logs = tmp_path / "logs"
    cluster = Cluster(model, prefill_workers=0, decode_workers=1, engine_args=(*ENGINE_ARGS, *TP2),
                      log_dir=str(logs))
    try:
        cluster.start(router=False)
        [pid] = rank_pids(logs / "decode-0.log")
        os.kill(pid, signal.SIGKILL)
        node = cluster.procs["decode-0"]
        assert node.wait(30) == RANK_DIED_EXIT
        assert f"error: tensor-parallel rank 1 of 2 (pid {pid}) exited with code -9" in (
            logs / "decode-0.log").read_text()
        assert gone(pid)
    finally:
        cluster.stop()


@pytest.mark.parametrize("role, flags, error", [
    ("decode", ("--tensor-parallel-size", "3"),
     "error: decode node: config field 'num_attention_heads': expected a multiple of tensor_parallel_size=3"),
    ("prefill", ("--tensor-parallel-size", "3"),
     "error: prefill node: config field 'num_attention_heads': expected a multiple of tensor_parallel_size=3"),
], ids=["decode", "prefill"])
def test_a_node_that_cannot_run_its_ranks_is_refused_at_start_before_any_starts(model, role, flags, error, capsys,
                                                                                monkeypatch):
    """An unsplittable config names the field, on either role."""
    monkeypatch.setenv(UCX_NET_DEVICES, "all")  # the node would set it for its transfers otherwise

    def no_rank(*args, **kwargs):
        raise AssertionError(f"a rank started: {args}")

    monkeypatch.setattr(RankProcesses, "__init__", no_rank)
    server = importlib.import_module(f"baton.{role}_node.server")
    assert server.main(["--model", model, "--port", "0", *ENGINE_ARGS, *flags]) == 2
    assert error in capsys.readouterr().err


def test_killing_rank_0_while_the_ranks_start_leaves_no_rank_behind(model):
    """Rank 0 killed outright before the group formed (rank 1 then waits at the rendezvous, where no peer's socket
    closes): the kernel ends rank 1 with it (`follower_main.die_with_parent`)."""
    script = ("import sys, time\nfrom baton.engine.engine_config import EngineConfig\n"
              "from baton.engine.parallel.rank_processes import RankProcesses\n"
              f"ranks = RankProcesses(sys.argv[1], EngineConfig(**{ENGINE}, device='cpu', tensor_parallel_size=2))\n"
              "print(ranks.init_method, *ranks.pids, flush=True)\ntime.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", script, model], stdout=subprocess.PIPE, text=True)
    try:
        init_method, pid = proc.stdout.readline().split()
        rendezvous = Path(init_method.removeprefix("file://"))
        deadline = time.monotonic() + 60
        while not rendezvous.exists():  # rank 1 has come to the rendezvous (it writes the file)
            assert time.monotonic() < deadline, "rank 1 did not reach the rendezvous"
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()
    assert gone(int(pid))


# The offline engine at two ranks generates, then a call changes rank 0's scheduler without being sent to rank 1
# (the base class's, past the recording).
OFFLINE_THEN_DRIFT = """
import json, sys, time
from baton.engine.engine_config import EngineConfig
from baton.engine.llm_engine import LLMEngine
from baton.engine.parallel.rank_processes import start_engine
from baton.engine.sampling_params import SamplingParams
from baton.node.transfer_listen import UCX_NET_DEVICES
engine = start_engine(sys.argv[1], EngineConfig(**{config}))
outs = engine.generate({prompts}, SamplingParams(max_tokens={max_tokens}, ignore_eos=True))
print(json.dumps([list(o.token_ids) for o in outs]), flush=True)
LLMEngine.add_request(engine, [5, 6, 7], SamplingParams(max_tokens=2))
try:
    engine.step()
finally:
    time.sleep(60)  # rank 1's end ends this process, through rank 0's watch
"""


def test_offline_engine_at_tp2_equals_one_rank_and_a_drifted_rank_stops_the_ranks(model, reference):
    config = {**ENGINE, "device": "cpu", "tensor_parallel_size": 2}
    script = OFFLINE_THEN_DRIFT.format(config=config, prompts=PROMPTS, max_tokens=MAX_TOKENS)
    proc = subprocess.run([sys.executable, "-c", script, model], capture_output=True, text=True, timeout=120)
    assert json.loads(proc.stdout.splitlines()[-1]) == reference, proc.stderr
    assert proc.returncode == RANK_DIED_EXIT, proc.stderr
    steps = re.search(r"expected rank 0's state before step (\d+) \(waiting, running, free blocks, free slots, "
                      r"steps\) \(1, 0, ", proc.stderr)
    assert steps and int(steps.group(1)) > 0, proc.stderr
    assert "error: tensor-parallel rank 1 of 2" in proc.stderr
