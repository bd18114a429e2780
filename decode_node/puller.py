"""Pulls a prefilled request's caches into this decode node: handshake (cached per peer), local blocks
and slot reserved on the engine thread, one coalesced NIXL READ on the transfer thread.

Any failure (peer gone, lease expired, no room before the lease ends, transfer error) returns None after
giving back what was reserved: the caller then prefills locally, so the client still gets its answer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import ssl
import time

from baton.engine.engine_thread import EngineThread
from baton.engine.llm_engine import LLMEngine
from baton.node.bridge import in_engine
from baton.node.rank_transfer import RankedTransfer
from baton.proto.auth import ClusterCredential
from baton.proto.v1 import worker_pb2 as wk
from baton.transfer.agent import TransferAgent
from baton.transfer.errors import TransferError
from baton.transfer.fault_injection import TransferFaults
from baton.transfer.side_channel import DEFAULT_TIMEOUT_S, SideChannelClient

log = logging.getLogger("baton.decode_node")
RESERVE_POLL_S = 0.005
LEASE_MARGIN_S = 1.0


class Puller:
    def __init__(self, agent: TransferAgent | RankedTransfer, thread: EngineThread, read_timeout_s: float = 10.0,
                 credential: ClusterCredential | None = None, ssl_context: ssl.SSLContext | None = None) -> None:
        """`credential` / `ssl_context`: what the prefill nodes' side channels ask of a caller."""
        self.agent = agent
        self.credential = credential
        self.ssl_context = ssl_context
        self.thread = thread
        self.read_timeout_s = read_timeout_s
        # NIXL calls of this agent stay on one thread; READs of host memory run inline in it.
        self._nixl = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="baton-transfer")
        self.num_fallbacks = 0
        # Test-only: none unless BATON_TEST_TRANSFER_FAULT_RATE is set (chaos tests run the fallback through it).
        self.faults = TransferFaults.from_environ()

    async def _on_nixl(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._nixl, fn, *args)

    async def pull(self, request_id: str, h: wk.TransferHandle, prompt: list[int]) -> tuple[list[int], int] | None:
        """Blocks and slot now holding the request's first `h.num_tokens` tokens, or None (fall back). Leading
        blocks that this node's prefix cache holds for the prompt already are not read again."""
        try:
            await self._connect(h)
            reserved = await self._reserve(h, prompt)
        except TransferError as e:
            log.warning("pull of %s from %s failed before the READ: %s", request_id, h.engine_id, e)
            self.num_fallbacks += 1
            return None
        if reserved is None:
            self.num_fallbacks += 1
            return None
        blocks, slot, held, after = reserved
        # A node of several ranks: each reads its shard once it has reserved the blocks too (`rank_transfer`).
        read = functools.partial(self.agent.read, after=after) if isinstance(self.agent, RankedTransfer) else self.agent.read
        try:
            self.faults.check(request_id, "before the READ")
            await self._on_nixl(read, h.request_id, h.engine_id, blocks[held:], list(h.kv_block_ids)[held:],
                                slot, h.state_slot, self.read_timeout_s)
            self.agent.stats.skipped_blocks += held
            self.faults.check(request_id, "after the READ")
        except asyncio.CancelledError:
            # The READ goes on on the transfer thread: give the blocks back after it (same thread, in order).
            self._nixl.submit(lambda: self.thread.call(lambda engine: engine.free_held(blocks, slot)))
            raise
        except TransferError as e:
            log.warning("READ of %s from %s failed: %s", request_id, h.engine_id, e)
            await in_engine(self.thread, lambda engine: engine.free_held(blocks, slot))
            self.num_fallbacks += 1
            return None
        return blocks, slot

    async def _connect(self, h: wk.TransferHandle) -> None:
        """Handshake with the request's prefill node on first contact (or after it restarted). The metadata call
        runs off the transfer thread, so that a peer slow to answer holds up no other request's READ, and within
        the READ's own timeout: a pull gives up on a stopped peer no later than a READ from it would."""
        def new_peer() -> bool:
            return self.agent.peer_agent_name(h.engine_id) != h.agent_name

        if not await self._on_nixl(new_peer):
            return
        client = SideChannelClient(h.side_channel_host, h.side_channel_port,
                                   timeout=min(DEFAULT_TIMEOUT_S, self.read_timeout_s), credential=self.credential,
                                   ssl_context=self.ssl_context)
        meta = await asyncio.to_thread(client.metadata)

        def connect() -> None:
            if new_peer():  # (another pull may have connected meanwhile)
                self.agent.connect(meta)

        await self._on_nixl(connect)

    async def _reserve(self, h: wk.TransferHandle, prompt: list[int]) -> tuple[list[int], int, int, int] | None:
        """Wait for room, but not past the lease: reading freed (maybe reused) blocks would be wrong. Returns the
        blocks, slot, leading blocks held already, and the commands rank 0 had sent to its other ranks then."""
        deadline = time.monotonic() + (h.lease_expiry - time.time()) - LEASE_MARGIN_S

        def reserve(engine: LLMEngine) -> tuple[list[int], int, int, int] | None:
            got = engine.reserve_for(prompt, h.num_tokens)
            return None if got is None else (*got, getattr(engine, "commands_sent", 0))

        while time.monotonic() < deadline:
            fut = self.thread.call(reserve)
            try:
                got = await asyncio.wrap_future(fut)
            except asyncio.CancelledError:
                # Cancelled while the engine thread may already have reserved: give back what it got.
                fut.add_done_callback(self._free_if_reserved)
                raise
            if got is not None:
                return got
            await asyncio.sleep(RESERVE_POLL_S)
        log.warning("no room for %s before its lease ends", h.request_id)
        return None

    def _free_if_reserved(self, fut: concurrent.futures.Future) -> None:
        if not fut.cancelled() and fut.exception() is None and fut.result() is not None:
            blocks, slot, _, _ = fut.result()
            self.thread.call(lambda engine: engine.free_held(blocks, slot))

    def close(self) -> None:
        self._nixl.shutdown(wait=True)
