"""NIXL transfers between two real OS processes on CPU (UCX): the prefill peer holds real engine pools,
this process is the decode side with its own engine pools.

Covers: bit-identical KV blocks and state slots for scattered block ids and several concurrent READs,
freeing on the decode side's notification, lease expiry, a killed peer, and a compatibility mismatch.
"""

import contextlib
import os
import random
import signal
import subprocess
import time

import pytest
import torch

from baton.engine.engine_config import EngineConfig
from baton.engine.llm_engine import LLMEngine
from baton.engine.make_model import make_model
from baton.transfer.agent import TransferAgent
from baton.transfer.errors import (
    IncompatiblePeer,
    LeaseExpired,
    PeerUnreachable,
    TransferError,
    TransferFailed,
    TransferTimeout,
)
from baton.transfer.side_channel import SideChannelClient
from tests.process_stop import stop
from tests.transfer_peer import call, start_peer

ENGINE_KW = {"block_size": 8, "max_num_seqs": 8, "max_num_batched_tokens": 64, "num_kv_blocks": 256}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("nixl") / "tiny"
    make_model(out, preset="tiny", seed=11, progress=False)
    return out


def decode_side(model_dir, engine_kw: dict, name: str, state_first: bool = True) -> tuple[LLMEngine, TransferAgent]:
    """This process's engine and its NIXL agent over the engine's pools (the agent's default read order unless
    told)."""
    engine = LLMEngine.from_pretrained(model_dir, EngineConfig(**engine_kw))
    return engine, TransferAgent(name, engine.model_config, engine.pools.by_name(), engine.config.block_size,
                                 state_first=state_first)


# A read as one NIXL READ carrying the notification (`TransferAgent(state_first=False)`, a decode node's
# --nixl-read-order one-read), or the state slot's READ first, then the blocks', then the notification (the default).
READ_ORDERS = [pytest.param(False, id="one-read"), pytest.param(True, id="state-first")]


@pytest.fixture(params=READ_ORDERS)
def decode(model_dir, request):
    engine, agent = decode_side(model_dir, {**ENGINE_KW, "num_kv_blocks": 300}, "decode-0", request.param)
    yield engine, agent
    agent.close()


@pytest.fixture
def decode_plain(model_dir):
    engine, agent = decode_side(model_dir, {**ENGINE_KW, "num_kv_blocks": 300}, "decode-0")
    yield engine, agent
    agent.close()


@pytest.fixture
def peer(model_dir):
    proc, conn, address = start_peer(model_dir, ENGINE_KW, lease_seconds=30.0)
    yield proc, conn, address
    if proc.is_alive():
        with contextlib.suppress(TimeoutError, EOFError, BrokenPipeError):
            call(conn, "quit", timeout=10)
        proc.join(10)
    if proc.is_alive():
        proc.kill()


def handshake(agent, address):
    agent.connect(SideChannelClient(*address).metadata())


def test_concurrent_reads_of_scattered_blocks_arrive_bit_identical(decode, peer):
    engine, agent = decode
    proc, conn, address = peer
    handshake(agent, address)
    handshake(agent, address)  # cached: one handshake per peer
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (2, 9, 40, 77, 130)]
    handles = call(conn, "prefill", prompts)
    assert [h.num_tokens for h in handles] == [len(p) - 1 for p in prompts]  # R1: N-1 computed
    assert any(sorted(h.kv_block_ids) != list(range(h.kv_block_ids[0], h.kv_block_ids[0] + len(h.kv_block_ids)))
               for h in handles), "the peer's blocks should be scattered"
    # Local blocks scattered too: a random half of the pool stays taken.
    sched = engine.cache
    every = sched.blocks.allocate(sched.blocks.num_free)
    rng.shuffle(every)
    sched.blocks.free(every[: len(every) // 2])
    taken = every[len(every) // 2:]
    local = [(sched.blocks.allocate(len(h.kv_block_ids)), sched.slots.allocate(1)[0]) for h in handles]
    pending = [agent.start_read(h.request_id, h.engine_id, blocks, list(h.kv_block_ids), slot, h.state_slot)
               for h, (blocks, slot) in zip(handles, local, strict=True)]
    for p in pending:
        agent.wait(p)
    for h, (blocks, slot) in zip(handles, local, strict=True):
        kv, conv, ssm = call(conn, "bytes", h.kv_block_ids, h.state_slot)
        assert torch.equal(engine.pools.kv[blocks].view(torch.int32), kv.view(torch.int32))
        assert torch.equal(engine.pools.states["conv"][slot].view(torch.int32), conv.view(torch.int32))
        assert torch.equal(engine.pools.states["ssm"][slot].view(torch.int32), ssm.view(torch.int32))
        assert ssm.abs().sum() > 0  # a real prefilled state, not zeros
    assert agent.stats.transfers == 5 and agent.stats.failures == 0
    assert agent.stats.bytes == sum(p.plan.num_bytes for p in pending)
    # The prefill side frees everything on the notifications.
    deadline = time.monotonic() + 10
    while (status := call(conn, "status"))["leases"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert status["blocks_used"] == 0 and status["slots_used"] == 0
    assert status["stats"].leases_completed == 5
    # A handle naming a block outside the peer's pool: a typed failure (the puller falls back), nothing moved.
    (blocks, slot), h = local[0], handles[0]
    with pytest.raises(TransferFailed, match=r"could not be planned: kv item: expected an id in \[0, \d+\), got"):
        agent.start_read("bad-ids", h.engine_id, blocks, [10**6] * len(blocks), slot, h.state_slot)
    assert agent.stats.failures == 1 and agent.stats.transfers == 5
    for blocks, slot in local:
        engine.free_held(blocks, slot)
    sched.blocks.free(taken)
    assert sched.blocks.num_used == 0 and sched.slots.num_used == 0


def test_lease_expiry_frees_and_refuses_renewal(model_dir, decode_plain):
    _, agent = decode_plain
    proc, conn, address = start_peer(model_dir, ENGINE_KW, lease_seconds=0.5, engine_id="prefill-lease")
    try:
        (h,) = call(conn, "prefill", [[5, 6, 7, 8, 9]])
        client = SideChannelClient(*address)
        assert client.renew(h.request_id, h.lease_id, 0.5) > 0.3  # decode may renew ...
        time.sleep(1.0)
        status = call(conn, "status")
        assert status["blocks_used"] == 0 and status["slots_used"] == 0
        assert status["stats"].lease_expiries == 1
        with pytest.raises(LeaseExpired):  # ... but not after expiry
            client.renew(h.request_id, h.lease_id)
    finally:
        call(conn, "quit")
        proc.join(10)


@pytest.mark.parametrize("state_first", READ_ORDERS)
def test_peer_killed_mid_transfer_gives_a_typed_failure_in_bounded_time_and_leaks_nothing(model_dir, state_first):
    # Pools of 256 MiB on both sides; each READ moves 128 MiB in 16384 scattered blocks.
    big = {**ENGINE_KW, "num_kv_blocks": 32768}
    proc, conn, address = start_peer(model_dir, big, engine_id="prefill-doomed")
    engine, agent = decode_side(model_dir, big, "decode-1", state_first)
    try:
        handshake(agent, address)
        h = call(conn, "hold_blocks", "big", 16384)  # scattered over the fragmented pool
        sched = engine.cache
        blocks, slot = sched.blocks.allocate(16384), sched.slots.allocate(1)[0]
        remote = list(h.kv_block_ids)
        # READs back to back while another process kills the peer: the kill lands inside one of them (UCX
        # moves host memory inside the transfer call), which must fail with a typed error, not hang.
        killer = subprocess.Popen(["sh", "-c", f"sleep 0.3; kill -9 {proc.pid}"])
        t_start = time.monotonic()
        with pytest.raises(TransferError) as failure:
            for i in range(10_000):
                agent.read(f"big-{i}", h.engine_id, blocks, remote, slot, h.state_slot, timeout=5.0)
        t_fail = time.monotonic() - t_start
        killer.wait()
        # The kill comes 0.3 s in, while READs run back to back (one may still be setting up its 16384
        # descriptors); the failure follows it within the deadline.
        assert 0.3 <= t_fail < 0.3 + 6.0
        proc.join(10)
        # Later READs from the dead peer fail within their deadline too; the side channel is gone.
        t0 = time.monotonic()
        with pytest.raises(TransferError):
            agent.read("again", h.engine_id, blocks[:4], remote[:4], slot, h.state_slot, timeout=2.0)
        assert time.monotonic() - t0 < 3.0
        with pytest.raises(PeerUnreachable):
            SideChannelClient(*address, timeout=1.0).metadata()
        assert agent.stats.failures == 2, failure.value
        engine.free_held(blocks, slot)
        assert sched.blocks.num_used == 0 and sched.slots.num_used == 0
    finally:
        agent.close()
        if proc.is_alive():
            proc.kill()


def test_incompatible_peer_is_refused_naming_the_field(model_dir, peer):
    _, _, address = peer
    _, agent = decode_side(model_dir, {**ENGINE_KW, "block_size": 16}, "decode-x")
    try:
        with pytest.raises(IncompatiblePeer, match="'block_size'"):
            handshake(agent, address)
        assert not agent.is_connected("prefill-0")
    finally:
        agent.close()


@pytest.mark.parametrize("state_first", READ_ORDERS)
def test_read_past_its_deadline_times_out_and_the_agent_stays_usable(model_dir, monkeypatch, state_first):
    # Over UCX's tcp transport a READ needs the peer process to answer it; with the peer stopped (SIGSTOP)
    # it cannot finish, whatever the machine's speed. The decode side must give up at its deadline with a
    # typed error, release the handle, and read fine once the peer runs again.
    monkeypatch.setenv("UCX_TLS", "tcp")
    proc, conn, address = start_peer(model_dir, ENGINE_KW, engine_id="prefill-slow")
    engine, agent = decode_side(model_dir, ENGINE_KW, "decode-2", state_first)
    try:
        handshake(agent, address)
        h = call(conn, "hold_blocks", "slow", 128)
        sched = engine.cache
        blocks, slot = sched.blocks.allocate(128), sched.slots.allocate(1)[0]
        remote = list(h.kv_block_ids)
        stop(proc.pid)
        try:
            t0 = time.monotonic()
            with pytest.raises(TransferTimeout):
                agent.read("slow", h.engine_id, blocks, remote, slot, h.state_slot, timeout=0.2)
            assert 0.2 <= time.monotonic() - t0 < 1.5
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        assert agent.stats.failures == 1 and agent.stats.transfers == 0
        agent.read("small", h.engine_id, blocks[:4], remote[:4], slot, h.state_slot, timeout=30.0)
        assert agent.stats.transfers == 1
        engine.free_held(blocks, slot)
        assert sched.blocks.num_used == 0 and sched.slots.num_used == 0
    finally:
        agent.close()
        call(conn, "quit")
        proc.join(10)


def test_an_idle_agent_does_not_spin_a_core_and_the_delay_is_checked(decode_plain):
    """NIXL's progress thread sleeps in poll() between passes (`progress_delay_us`, default 1 ms): an idle agent costs
    a few percent of a core, not all of it (with NIXL's own delay of 0 it burned 1 s of CPU a second). The process's
    other threads are idle here too, so its CPU time over the second is the thread's."""
    import resource

    engine, agent = decode_plain
    before = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(1.0)
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert cpu < 0.3, f"{cpu:.2f} s of CPU in 1 s while idle: the progress thread spins"
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="progress_delay_us: expected an integer >= 0"):
            TransferAgent("bad", engine.model_config, engine.pools.by_name(), engine.config.block_size,
                          progress_delay_us=bad)


def test_decode_node_reads_state_first_by_default_and_refuses_an_unknown_order(capsys):
    from baton.decode_node.server import parser

    base = ["--model", "m", "--port", "1"]
    assert parser().parse_args(base).nixl_read_order == "state-first"
    assert parser().parse_args([*base, "--nixl-read-order", "one-read"]).nixl_read_order == "one-read"
    with pytest.raises(SystemExit) as e:
        parser().parse_args([*base, "--nixl-read-order", "blocks-first"])
    assert e.value.code == 2
    assert "invalid choice: 'blocks-first' (choose from" in capsys.readouterr().err
