"""A prefill-side peer in its own OS process, for the NIXL transfer tests.

It runs a real engine on a checkpoint, registers the engine's pools with a `TransferAgent`, serves its
metadata and lease renewals on a side channel and holds finished prefills under leases. The test
process (the decode side) drives it over a multiprocessing pipe:

  ("prefill", [prompt, ...])           -> [TransferHandle, ...]   prompts prefilled (prefill-only), held
  ("hold_blocks", request_id, n)       -> TransferHandle          lease n blocks + a slot, pools as they are
  ("bytes", block_ids, slot)           -> (kv, conv, ssm) copies of those items
  ("fill", seed)                       -> None                    random bytes in the whole pools
  ("status",)                          -> dict of counters and pool usage
  ("quit",)                            -> None
"""

from __future__ import annotations

import multiprocessing as mp
import random

import torch


def run_peer(conn, model_dir: str, engine_kw: dict, lease_seconds: float, engine_id: str,
             agent_kw: dict | None = None) -> None:
    from baton.engine.engine_config import EngineConfig
    from baton.engine.llm_engine import LLMEngine
    from baton.engine.sampling_params import SamplingParams
    from baton.transfer.agent import TransferAgent
    from baton.transfer.held_transfers import HeldTransfers
    from baton.transfer.lease import LeaseTable
    from baton.transfer.side_channel import SideChannelServer

    engine = LLMEngine.from_pretrained(model_dir, EngineConfig(**engine_kw))
    sched = engine.cache
    # Fragment the pool: a random half of the blocks stays taken, so held requests own scattered blocks.
    every = sched.blocks.allocate(sched.blocks.num_free)
    random.Random(0).shuffle(every)
    sched.blocks.free(every[: len(every) // 2])
    fragment = sched.blocks.num_used
    pools = engine.pools.by_name()
    agent = TransferAgent(engine_id, engine.model_config, pools, engine.config.block_size, **(agent_kw or {}))
    held = HeldTransfers(agent, LeaseTable(lease_seconds), free=lambda lease: engine.free_held(lease.block_ids,
                                                                                             lease.state_slot))
    server = SideChannelServer(lambda: agent.metadata, held.renew)
    conn.send(("ready", server.address))
    while True:
        if conn.poll(0.001):
            cmd, *args = conn.recv()
            if cmd == "quit":
                conn.send(None)
                break
            if cmd == "prefill":
                ids = [engine.add_request(p, SamplingParams(max_tokens=1), prefill_only=True) for p in args[0]]
                done = {}
                while engine.has_unfinished():
                    for o in engine.step():
                        if o.finished:
                            done[o.request_id] = o
                conn.send([held.hold(r, done[r].held_block_ids, done[r].held_state_slot,
                                     len(done[r].prompt_token_ids) - 1) for r in ids])
            elif cmd == "hold_blocks":
                request_id, n = args
                blocks, slot = sched.blocks.allocate(n), sched.slots.allocate(1)[0]
                conn.send(held.hold(request_id, tuple(blocks), slot, n * engine.config.block_size))
            elif cmd == "bytes":
                blocks, slot = args
                conn.send((engine.pools.kv[list(blocks)].cpu(), engine.pools.conv[slot].cpu(),
                           engine.pools.ssm[slot].cpu()))
            elif cmd == "fill":
                g = torch.Generator().manual_seed(args[0])
                for t in pools.values():
                    t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32).to(t.device))
                conn.send(None)
            elif cmd == "status":
                conn.send({"blocks_used": sched.blocks.num_used - fragment, "slots_used": sched.slots.num_used,
                           "leases": len(held.leases), "stats": agent.stats})
        held.poll()
    server.close()
    agent.close()


def start_peer(model_dir, engine_kw: dict, lease_seconds: float = 30.0, engine_id: str = "prefill-0",
               agent_kw: dict | None = None):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=run_peer, args=(child, str(model_dir), engine_kw, lease_seconds, engine_id, agent_kw),
                       daemon=True)
    proc.start()
    if not parent.poll(120):
        proc.kill()
        raise RuntimeError("transfer peer did not start within 120 s")
    tag, address = parent.recv()
    assert tag == "ready"
    return proc, parent, address


def call(conn, *msg, timeout: float = 60.0):
    conn.send(msg)
    if not conn.poll(timeout):
        raise TimeoutError(f"transfer peer did not answer {msg[0]!r} within {timeout} s")
    return conn.recv()
