"""Same-host CUDA IPC reads (`baton.transfer.cuda_ipc`): the plan's byte ranges, the metadata that offers the
mapping, when a peer is read through it or through NIXL, and the notification that frees the holder's lease
(on the CPU, between two real processes); the copy itself on a GPU (`gpu`: the holder in another process)."""

from __future__ import annotations

import contextlib
import random
import time

import msgspec
import pytest
import torch

from baton.engine.engine_config import EngineConfig
from baton.engine.llm_engine import LLMEngine
from baton.engine.make_model import make_model
from baton.transfer.agent import TransferAgent
from baton.transfer.cuda_ipc import IpcRegion, export_regions, host_id
from baton.transfer.errors import PeerUnreachable, TransferFailed
from baton.transfer.layout import RegionLayout
from baton.transfer.metadata import AgentMetadata, CompatInfo, single_rank_shards
from baton.transfer.side_channel import SideChannelClient
from tests.transfer_peer import call, start_peer

ENGINE_KW = {"block_size": 8, "max_num_seqs": 8, "max_num_batched_tokens": 64, "num_kv_blocks": 256}


def layouts(base: int) -> dict[str, RegionLayout]:
    return {"kv": RegionLayout("kv", base, 64, 1024, (2, 2, 8, 2, 4), "bfloat16", "VRAM", 0),
            "conv": RegionLayout("conv", base + (1 << 20), 9, 96, (3, 8, 3), "bfloat16", "VRAM", 0),
            "ssm": RegionLayout("ssm", base + (2 << 20), 9, 512, (3, 2, 4, 8), "float32", "VRAM", 0)}


def test_metadata_offers_ipc_regions_and_older_metadata_still_decodes():
    region = IpcRegion(b"h" * 64, 1 << 20, 0, b"rc", 3, b"", False, 256)
    compat = CompatInfo(protocol_version=1, model_fingerprint="f", layer_pattern="M*", tp_size=1, block_size=8,
                        dtypes={"kv": "bfloat16", "conv": "bfloat16", "ssm": "float32"},
                        shards=single_rank_shards(layouts(0)), num_speculative_tokens=0, mtp_layers=0)
    meta = AgentMetadata("e", "a", b"nixl", compat, "x", layouts(0), host_id=host_id(), ipc={"kv": region})
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(meta), type=AgentMetadata)
    assert back.ipc == {"kv": region} and back.host_id == host_id() != ""
    # Metadata from a node without these fields: no host, no IPC (its peers read through NIXL), one rank.
    old = {k: v for k, v in msgspec.msgpack.decode(msgspec.msgpack.encode(meta)).items()
           if k not in ("host_id", "ipc", "tp_rank", "ranks")}
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(old), type=AgentMetadata)
    assert back.host_id == "" and back.ipc == {} and back.tp_rank == 0 and back.ranks == ()
    assert [r.agent_name for r in back.rank_agents()] == ["a"]


def test_pools_in_host_memory_offer_no_mapping():
    assert export_regions({"kv": torch.zeros(4, 8), "ssm": torch.zeros(0)}) == {}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("ipc") / "tiny"
    make_model(out, preset="tiny", seed=11, progress=False)
    return out


@contextlib.contextmanager
def holder(model_dir, engine_kw: dict, agent_kw: dict, engine_id: str):
    proc, conn, address = start_peer(model_dir, engine_kw, engine_id=engine_id, agent_kw=agent_kw)
    try:
        yield conn, address
    finally:
        with contextlib.suppress(TimeoutError, EOFError, BrokenPipeError):
            call(conn, "quit", timeout=10)
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def wait_for_no_leases(conn, seconds: float = 10.0) -> dict:
    deadline = time.monotonic() + seconds
    while (status := call(conn, "status"))["leases"] and time.monotonic() < deadline:
        time.sleep(0.01)
    return status


def test_cpu_pools_are_read_through_nixl_and_a_notification_alone_frees_the_lease(model_dir):
    """With cuda_ipc on both sides but pools in host memory, reads go through NIXL; `notify` (what a CUDA IPC
    copy sends when done) reaches the holder as a READ's notification does and frees its lease."""
    engine = LLMEngine.from_pretrained(model_dir, EngineConfig(**ENGINE_KW))
    agent = TransferAgent("decode-ipc", engine.model_config, engine.pools.by_name(), engine.config.block_size,
                          cuda_ipc=True, ipc_reads=True)
    try:
        assert agent.metadata.ipc == {} and agent.metadata.host_id == host_id()
        assert agent._copier is None  # a reader with nothing to map builds no copier
        with holder(model_dir, ENGINE_KW, {"cuda_ipc": True}, "prefill-ipc") as (conn, address):
            with pytest.raises(PeerUnreachable):
                agent.notify("prefill-ipc", "r0")  # no handshake yet
            agent.connect(SideChannelClient(*address).metadata())
            assert not agent.reads_by_cuda_ipc("prefill-ipc")
            read, notified = call(conn, "prefill", [[5, 6, 7, 8, 9, 10, 11], [3, 4, 5]])
            blocks, slot = engine.reserve(read.num_tokens)
            agent.read(read.request_id, read.engine_id, blocks, list(read.kv_block_ids), slot, read.state_slot)
            kv, _, ssm = call(conn, "bytes", read.kv_block_ids, read.state_slot)
            assert torch.equal(engine.pools.kv[blocks], kv) and torch.equal(engine.pools.states["ssm"][slot], ssm)
            agent.notify(notified.engine_id, notified.request_id)
            status = wait_for_no_leases(conn)
            assert status["leases"] == 0 and status["blocks_used"] == 0 and status["slots_used"] == 0
            assert status["stats"].leases_completed == 2
            engine.free_held(blocks, slot)
    finally:
        agent.close()


@pytest.mark.gpu
def test_gpu_same_host_reads_go_through_cuda_ipc_bit_identical_and_free_the_lease(model_dir):
    kw = {**ENGINE_KW, "device": "cuda", "num_kv_blocks": 512}
    engine = LLMEngine.from_pretrained(model_dir, EngineConfig(**kw))
    agent = TransferAgent("decode-ipc-gpu", engine.model_config, engine.pools.by_name(), engine.config.block_size,
                          cuda_ipc=True, ipc_reads=True)
    try:
        assert set(agent.metadata.ipc) == {"kv", "conv", "ssm"}
        copier = agent._copier  # built (its kernel compiled) before any peer, as a decode node's is
        assert copier is not None
        with holder(model_dir, kw, {"cuda_ipc": True}, "prefill-ipc-gpu") as (conn, address):
            call(conn, "fill", 7)  # every pool byte seeded: a wrong offset reads other values
            agent.connect(SideChannelClient(*address).metadata())
            assert agent.reads_by_cuda_ipc("prefill-ipc-gpu")
            rng = random.Random(1)
            handles = [call(conn, "hold_blocks", f"r{i}", n) for i, n in enumerate((1, 7, 33, 64))]
            local = []
            for h in handles:
                # Scattered local blocks: every other free block.
                blocks = engine.cache.blocks.allocate(2 * len(h.kv_block_ids))
                rng.shuffle(blocks)
                engine.cache.blocks.free(blocks[len(h.kv_block_ids):])
                local.append((blocks[:len(h.kv_block_ids)], engine.cache.slots.allocate(1)[0]))
            pending = [agent.start_read(h.request_id, h.engine_id, b, list(h.kv_block_ids), s, h.state_slot)
                       for h, (b, s) in zip(handles, local, strict=True)]
            for p in pending:
                agent.wait(p)
                assert p.event is not None and p.handle is None  # the copy path, not a NIXL handle
            for h, (b, s) in zip(handles, local, strict=True):
                kv, conv, ssm = call(conn, "bytes", h.kv_block_ids, h.state_slot)
                assert torch.equal(engine.pools.kv[b].cpu(), kv)
                assert torch.equal(engine.pools.states["conv"][s].cpu(), conv) and torch.equal(engine.pools.states["ssm"][s].cpu(), ssm)
            assert agent.stats.transfers == 4 and agent.stats.failures == 0
            assert wait_for_no_leases(conn)["leases"] == 0
            # A bad block id: refused after the slot's copy (queued first) has landed, so nothing still writes.
            h, (b, s) = handles[0], local[0]
            with pytest.raises(TransferFailed, match="could not be planned: kv item: expected an id in"):
                agent.start_read("bad-ids", h.engine_id, b, [10**6] * len(b), s, h.state_slot)
            assert agent._copier is copier and copier.stream.query()
    finally:
        agent.close()
