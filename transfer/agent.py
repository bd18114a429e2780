"""`TransferAgent`: a node's NIXL agent, its once-registered cache pools and its handshaken peers.

The decode side pulls: `start_read` issues one NIXL READ for a request (coalesced descriptors, a
notification naming the request id for the prefill side), `wait`/`poll` finish it within a deadline and
always release the handle. By default (`state_first=True`) it is two READs, the state slot's posted before the
blocks are planned, and the agent sends the notification once both are done; `state_first=False` posts one READ of
both. The prefill side calls `notifications()` to learn which requests were read.

With `cuda_ipc=True` on both sides and both on one host with GPU pools, the READ is instead a copy through
the holder's pools mapped once at the handshake (`transfer.cuda_ipc`), followed by the same notification,
sent with NIXL's `send_notif`. Any other peer, or a mapping that fails to open, is read through NIXL.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from dataclasses import dataclass, field

import msgspec
import torch

from baton.engine.config import ModelConfig
from baton.transfer.cuda_ipc import IpcCopier, IpcPeer, export_regions, host_id
from baton.transfer.errors import PeerUnreachable, TransferError, TransferFailed, TransferTimeout
from baton.transfer.layout import RegionLayout
from baton.transfer.metadata import AgentMetadata, RankAgent, check_compatible, compat_hash, make_compat
from baton.transfer.plan import (
    TransferPlan,
    block_ids,
    check_pair,
    empty_plan,
    join,
    plan_blocks,
    plan_checked_blocks,
    plan_request,
    plan_slots,
    state_names,
)
from baton.transfer.shard_map import PoolShards
from baton.transfer.sharded_read import ShardedPeer, plan_sharded
from baton.transfer.stats import TransferStats

log = logging.getLogger("baton.transfer")
DEFAULT_TIMEOUT_S = 10.0
# How a NIXL read is posted (`TransferAgent(state_first=...)`, a decode node's --nixl-read-order).
READ_ORDERS = ("state-first", "one-read")
SPIN_SECONDS = 0.005


# NIXL's UCX progress thread sleeps in poll() on the workers' event fds for up to this long between passes. NIXL's
# Python agent sets 0, and then the thread never sleeps: each node process burns a whole core, idle or not, and on
# a GPU host that slows the host work of a CUDA IPC read. A READ's own polls (`wait`) progress its worker meanwhile; an
# incoming notification wakes the thread through the fd, the delay only bounds a missed wake-up.
DEFAULT_PROGRESS_DELAY_US = 1000


def _nixl():
    # Imported lazily so that `baton.transfer` metadata, plans and leases work without the NIXL wheels.
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent, nixl_agent_config


def _new_nixl_agent(name: str, config: object, progress_delay_us: int) -> object:
    """`nixl_agent(name, config)` with the progress thread's delay set: NIXL's Python wrapper writes
    `pthrDelay = 0` into the config it builds, so its config class is swapped, for this call only, for one that
    keeps ours."""
    from nixl import _api

    nixl_agent, _ = _nixl()
    bind = getattr(_api, "nixlBind", None)
    if progress_delay_us == 0 or bind is None or not hasattr(bind, "nixlAgentConfig"):
        if progress_delay_us:
            log.warning("this NIXL build's Python agent has no nixlBind.nixlAgentConfig to set the progress "
                        "thread's delay in: it keeps NIXL's own (0: a busy core)")
        return nixl_agent(name, config)
    base = bind.nixlAgentConfig

    class _Config(base):  # type: ignore[misc, valid-type]
        def __setattr__(self, key: str, value: object) -> None:
            super().__setattr__(key, progress_delay_us if key == "pthrDelay" else value)

    bind.nixlAgentConfig = _Config
    try:
        return nixl_agent(name, config)
    finally:
        bind.nixlAgentConfig = base


@dataclass
class PendingRead:
    request_id: str
    peer: str          # the remote engine id
    plan: TransferPlan
    handle: object
    started: float
    deadline: float
    state: str = "PROC"
    # A CUDA IPC copy (handle None): the event its copies complete.
    event: torch.cuda.Event | None = None
    # State first (`TransferAgent(state_first=True)`): the state slot's own READ, posted before the blocks were
    # planned (None once it is done, or when not used); `notify`: neither READ carries the notification, this
    # agent sends it once both are done.
    slot_handle: object = None
    notify: bool = False
    # A read rank by rank (`ShardedPeer`): the READs from the other peer ranks, polled before `handle`.
    more: list[object] = field(default_factory=list)


class TransferAgent:
    def __init__(self, engine_id: str, model_cfg: ModelConfig, pools: dict[str, torch.Tensor], block_size: int,
                 num_speculative_tokens: int = 0, backends: tuple[str, ...] = ("UCX",),
                 progress_thread: bool = True, num_threads: int = 0, cuda_ipc: bool = False,
                 progress_delay_us: int = DEFAULT_PROGRESS_DELAY_US, state_first: bool = True,
                 shards: dict[str, PoolShards] | None = None, tp_rank: int = 0, ipc_reads: bool = False) -> None:
        """`pools`: the id-major cache pools by name ("kv", then the state pools), registered once, here.
        `progress_thread=False` makes NIXL progress only when this agent is polled; `num_threads` > 0 gives
        the UCX backend that many worker threads (large transfers are split across them). `cuda_ipc`: offer
        this node's GPU pools to same-host peers as CUDA IPC mappings, and read from peers that offer theirs.
        `progress_delay_us`: the longest sleep of the progress thread between passes (0: it never sleeps, NIXL's own
        default: one busy core per agent). `state_first` (default): a NIXL read posts the request's state slot (a
        third of a 16k-token 8b-like request, all of a short one) as its own READ before it plans and posts the
        blocks, so the link starts while the host still works (the CUDA IPC path's order); the notification then
        follows both. False: one READ of blocks and state. `shards`: how the node's tensor-parallel ranks split each
        pool (`shard_map.pool_shards`; None: one rank holds them whole), `tp_rank` the rank whose `pools` these are;
        peers of other TP sizes (or this node's ranks > 1) are read rank by rank (`read`). `ipc_reads`: this node
        reads (a decode node): with CUDA IPC offered at one rank, the copier is built here, compiling its kernel
        before the node serves, rather than at the first same-host peer's handshake, which that request's READ waits
        for."""
        if not isinstance(progress_delay_us, int) or isinstance(progress_delay_us, bool) or progress_delay_us < 0:
            raise ValueError(f"progress_delay_us: expected an integer >= 0, got {progress_delay_us!r}")
        _, nixl_agent_config = _nixl()
        self.engine_id = engine_id
        self.regions = {name: RegionLayout.of(name, t) for name, t in pools.items()}
        self._pools = pools  # registered memory must outlive the registration
        # NIXL agent names must be unique among the peers one agent knows.
        self.agent_name = f"{engine_id}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._agent = _new_nixl_agent(self.agent_name, nixl_agent_config(enable_prog_thread=progress_thread,
                                                                         num_threads=num_threads,
                                                                         backends=list(backends)),
                                      progress_delay_us)
        self._reg = self._agent.register_memory([t for t in pools.values() if t.numel()])
        compat = make_compat(model_cfg, self.regions, block_size, num_speculative_tokens, shards)
        self.tp_rank = tp_rank
        self.cuda_ipc = cuda_ipc
        self.state_first = state_first
        self.metadata = AgentMetadata(engine_id=engine_id, agent_name=self.agent_name,
                                      nixl_metadata=self._agent.get_agent_metadata(), compat=compat,
                                      compat_hash=compat_hash(compat), regions=self.regions, host_id=host_id(),
                                      ipc=export_regions(pools) if cuda_ipc else {}, tp_rank=tp_rank)
        self._peers: dict[str, tuple[str, AgentMetadata]] = {}
        # Peers read rank by rank (either side of several ranks): what this rank reads from which of theirs.
        self._sharded: dict[str, ShardedPeer] = {}
        self._ipc_peers: dict[str, IpcPeer] = {}
        self._copier: IpcCopier | None = None
        self.stats = TransferStats()
        # A node of several ranks reads rank by rank through NIXL (`connect`), never through the copier.
        if ipc_reads and self.metadata.ipc and compat.tp_size == 1:
            try:
                self._copier = IpcCopier(self._pools)
            except Exception as e:  # built again at the first same-host handshake, or read through NIXL
                log.warning("CUDA IPC copier not built at start: %s: %s", type(e).__name__, e)

    # ---- handshake --------------------------------------------------------------------------------
    def connect(self, remote: AgentMetadata) -> None:
        """Load a peer's metadata once (cached by engine id); refuses an incompatible peer."""
        cached = self._peers.get(remote.engine_id)
        if cached is not None and cached[1].agent_name == remote.agent_name:
            return
        check_compatible(self.metadata, remote)
        if cached is not None:  # the peer restarted: a new agent behind the same engine id
            self.forget(remote.engine_id)
        if self.metadata.compat.tp_size == remote.compat.tp_size == 1:
            name = self._add_remote(remote.engine_id, remote.nixl_metadata)
            self._peers[remote.engine_id] = (name, remote)
            self._map_peer(remote)
            return
        peer = ShardedPeer.of(remote, self.metadata.compat.shards, self.tp_rank)
        names: dict[int, str] = {}
        try:
            # Its rank 0 too, whether read or not: the READ's notification goes there.
            for rank in sorted({0, *peer.sources}):
                names[rank] = self._add_remote(remote.engine_id, remote.rank_agents()[rank].nixl_metadata)
        except PeerUnreachable:
            for name in names.values():
                with contextlib.suppress(Exception):
                    self._agent.remove_remote_agent(name)
            raise
        peer.names = names
        self._sharded[remote.engine_id] = peer
        self._peers[remote.engine_id] = (names[0], remote)

    def _add_remote(self, engine_id: str, nixl_metadata: bytes) -> str:
        try:
            return self._agent.add_remote_agent(nixl_metadata)
        except Exception as e:  # nixl binding errors have no common base class
            raise PeerUnreachable(f"loading {engine_id}'s NIXL metadata: {type(e).__name__}: {e}",
                                  peer=engine_id) from e

    def with_ranks(self, ranks: tuple[RankAgent, ...]) -> None:
        """Rank 0 of a node of several ranks: publish every rank's agent (this one first) with this one's."""
        if [r.tp_rank for r in ranks] != list(range(self.metadata.compat.tp_size)):
            raise ValueError(f"rank agents: expected ranks 0..{self.metadata.compat.tp_size - 1} in order, got "
                             f"{[r.tp_rank for r in ranks]}")
        self.metadata = msgspec.structs.replace(self.metadata, ranks=ranks)

    def rank_agent(self) -> RankAgent:
        """This rank's agent, as rank 0 publishes it."""
        return RankAgent(self.tp_rank, self.agent_name, self.metadata.nixl_metadata, self.regions)

    def _map_peer(self, remote: AgentMetadata) -> None:
        """Map a same-host peer's GPU pools for CUDA IPC reads, if both sides offer them; else NIXL reads."""
        mine = self.metadata
        if not (self.cuda_ipc and mine.ipc and remote.ipc and remote.host_id == mine.host_id
                and set(remote.ipc) == set(mine.ipc)):
            return
        try:
            if self._copier is None:
                self._copier = IpcCopier(self._pools)
            self._ipc_peers[remote.engine_id] = IpcPeer(remote.ipc, remote.regions, self._copier.device)
        except Exception as e:  # a peer whose memory cannot be mapped here is still read through NIXL
            log.warning("CUDA IPC mapping of %s's pools failed, reading through NIXL: %s: %s", remote.engine_id,
                        type(e).__name__, e)

    def reads_by_cuda_ipc(self, engine_id: str) -> bool:
        """Whether READs from this peer go through its CUDA IPC mapping (else through NIXL)."""
        return engine_id in self._ipc_peers

    def is_connected(self, engine_id: str) -> bool:
        return engine_id in self._peers

    def peer_agent_name(self, engine_id: str) -> str | None:
        """The NIXL agent name of a handshaken peer (changes when the peer restarts), or None."""
        entry = self._peers.get(engine_id)
        return entry[1].agent_name if entry is not None else None

    def forget(self, engine_id: str) -> None:
        self._ipc_peers.pop(engine_id, None)
        entry = self._peers.pop(engine_id, None)
        sharded = self._sharded.pop(engine_id, None)
        names = list(sharded.names.values()) if sharded is not None else [entry[0]] if entry is not None else []
        for name in names:
            # Already gone on the NIXL side: nothing left to clean.
            with contextlib.suppress(Exception):
                self._agent.remove_remote_agent(name)

    # ---- decode side: READ ------------------------------------------------------------------------
    def start_read(self, request_id: str, peer: str, local_blocks: list[int], remote_blocks: list[int],
                   local_slot: int, remote_slot: int, timeout: float = DEFAULT_TIMEOUT_S,
                   coalesced: bool = True, split_layers: bool = False) -> PendingRead:
        if peer not in self._peers:
            raise PeerUnreachable(f"no handshake with {peer!r} yet", request_id=request_id, peer=peer)
        name, remote = self._peers[peer]
        t0 = time.monotonic()
        if peer in self._sharded:
            return self._start_sharded(request_id, peer, local_blocks, remote_blocks, local_slot, remote_slot, t0,
                                       timeout)
        ipc = self._ipc_peers.get(peer)
        try:
            if ipc is not None:
                plan = self._start_copy(ipc, remote, local_blocks, remote_blocks, local_slot, remote_slot, coalesced,
                                        split_layers)
                event = self._copier.done()
                self.stats.descriptors += plan.num_descriptors
                return PendingRead(request_id, peer, plan, None, t0, t0 + timeout, event=event)
            if self.state_first:
                return self._start_state_first(request_id, peer, name, remote, local_blocks, remote_blocks,
                                               local_slot, remote_slot, coalesced, split_layers, t0, timeout)
            plan = plan_request(self.regions, remote.regions, local_blocks, remote_blocks, local_slot, remote_slot,
                                coalesced=coalesced, split_layers=split_layers)
        except ValueError as e:  # ids outside a pool, or mismatched lists: nothing was left moving
            self.stats.failures += 1
            raise TransferFailed(f"READ of {request_id!r} from {peer!r} could not be planned: {e}",
                                 request_id=request_id, peer=peer) from e
        handle, state = self._post(request_id, peer, name, remote, plan, request_id.encode())
        pending = PendingRead(request_id, peer, plan, handle, t0, t0 + timeout, state)
        self.stats.descriptors += plan.num_descriptors
        return pending

    def _start_sharded(self, request_id: str, peer: str, local_blocks: list[int], remote_blocks: list[int],
                       local_slot: int, remote_slot: int, t0: float, timeout: float) -> PendingRead:
        """One READ per peer rank this rank reads from (`sharded_read`). A node of one rank notifies the peer once
        all are done; at several ranks, rank 0 does once every rank's are (`node.rank_transfer`)."""
        sp = self._sharded[peer]
        try:
            plans = plan_sharded(sp, self.regions, local_blocks, remote_blocks, local_slot, remote_slot)
        except ValueError as e:
            self.stats.failures += 1
            raise TransferFailed(f"READ of {request_id!r} from {peer!r} could not be planned: {e}",
                                 request_id=request_id, peer=peer) from e
        posted: list[tuple[object, str]] = []
        try:
            for rank, plan in plans.items():
                if plan.num_descriptors:
                    posted.append(self._post(request_id, peer, sp.names[rank], sp.regions(rank)["kv"].mem_type,
                                             plan, b""))
        except TransferFailed:
            for handle, state in posted:
                self._drain(handle, state, t0 + timeout)
            raise
        plan = join(*plans.values()) if plans else empty_plan()
        self.stats.descriptors += plan.num_descriptors
        notify = self.metadata.compat.tp_size == 1
        if not posted:
            return PendingRead(request_id, peer, plan, None, t0, t0 + timeout, "DONE", notify=notify)
        failed = next((st for _, st in posted if st not in ("PROC", "DONE")), None)
        state = failed or ("DONE" if all(st == "DONE" for _, st in posted) else "PROC")
        return PendingRead(request_id, peer, plan, posted[-1][0], t0, t0 + timeout, state, notify=notify,
                           more=[h for h, _ in posted[:-1]])

    def _post(self, request_id: str, peer: str, name: str, remote: AgentMetadata | str, plan: TransferPlan,
              notif: bytes) -> tuple[object, str]:
        """One NIXL READ of the plan's descriptors, posted: (handle, state). A failure is counted and raised typed,
        the handle (if any) released. `remote`: the peer's metadata, or its pools' memory type."""
        handle = None
        mem_type = remote if isinstance(remote, str) else remote.regions["kv"].mem_type
        try:
            handle = self._agent.initialize_xfer(
                "READ", self._agent.get_xfer_descs(plan.local, self.regions["kv"].mem_type),
                self._agent.get_xfer_descs(plan.remote, mem_type), name, notif)
            return handle, self._agent.transfer(handle)
        except Exception as e:
            self.stats.failures += 1
            if handle is not None:
                with contextlib.suppress(Exception):
                    self._agent.release_xfer_handle(handle)
            raise TransferFailed(f"READ of {request_id!r} from {peer!r} could not start: {type(e).__name__}: {e}",
                                 request_id=request_id, peer=peer) from e

    def _start_state_first(self, request_id: str, peer: str, name: str, remote: AgentMetadata, local_blocks: list[int],
                           remote_blocks: list[int], local_slot: int, remote_slot: int, coalesced: bool,
                           split_layers: bool, t0: float, timeout: float) -> PendingRead:
        """The state slot's READ first, then the blocks' (module docstring, `state_first`). Bad block ids raise
        once the slot's READ has ended (landed, failed, or past the deadline): nothing is left writing into
        memory the caller frees."""
        slots = plan_slots(self.regions, remote.regions, local_slot, remote_slot)  # bad slot: ValueError, none posted
        slot_handle, state = self._post(request_id, peer, name, remote, slots, b"")
        try:
            blocks = plan_blocks(self.regions, remote.regions, local_blocks, remote_blocks, coalesced, split_layers)
            handle, block_state = (self._post(request_id, peer, name, remote, blocks, b"") if blocks.num_descriptors
                                   else (None, "DONE"))
        except (ValueError, TransferFailed):
            self._drain(slot_handle, state, t0 + timeout)
            raise
        plan = join(blocks, slots)
        self.stats.descriptors += plan.num_descriptors
        if handle is None:  # no blocks (a pool without attention layers): the slot's READ is the whole read
            return PendingRead(request_id, peer, plan, slot_handle, t0, t0 + timeout, state, notify=True)
        # Polled until both are done (NIXL keeps a done READ's state: checking it again is free).
        failed = next((st for st in (state, block_state) if st not in ("PROC", "DONE")), None)
        both = failed or ("DONE" if state == block_state == "DONE" else "PROC")
        return PendingRead(request_id, peer, plan, handle, t0, t0 + timeout, both, slot_handle=slot_handle,
                           notify=True)

    def _drain(self, handle: object, state: str, deadline: float) -> None:
        """Let a READ that its read gave up on end (landed, failed, or past the deadline), then release it;
        counted as nothing: the read it belonged to fails as a whole."""
        while state == "PROC" and time.monotonic() <= deadline:
            time.sleep(0.0002)
            try:
                state = self._agent.check_xfer_state(handle)
            except Exception:
                break
        with contextlib.suppress(Exception):
            self._agent.release_xfer_handle(handle)

    def _start_copy(self, ipc: IpcPeer, remote: AgentMetadata, local_blocks: list[int], remote_blocks: list[int],
                    local_slot: int, remote_slot: int, coalesced: bool, split_layers: bool) -> TransferPlan:
        """Queue a CUDA IPC read's copies, host work kept off the copies' path: the state slot first (its 100 MiB of a
        16k-token 8b-like request move while the block ids are checked), then the blocks straight from their ids;
        the descriptor plan (what the read moved, for the stats) is built after, while the bytes move. Bad block ids
        (or a bad slot) raise once any copy queued has landed: nothing is left writing into memory the caller frees."""
        assert self._copier is not None
        kv = self.regions["kv"]
        try:
            # The large ones first: the link starts on them sooner.
            for name in sorted(state_names(self.regions), key=lambda n: -self.regions[n].item_bytes):
                lay, rlay = self.regions[name], remote.regions[name]
                if lay.item_bytes:
                    check_pair(lay, rlay)
                    self._copier.copy_item(ipc, name, lay.item_addr(local_slot) - lay.base_addr,
                                           rlay.item_addr(remote_slot) - rlay.base_addr, lay.item_bytes)
            lo, re = block_ids(kv, remote.regions["kv"], local_blocks, remote_blocks)
        except ValueError:
            self._copier.wait_idle()
            raise
        if len(lo) and kv.item_bytes:
            self._copier.copy(ipc, "kv", lo, re, kv.item_bytes)
        return join(plan_checked_blocks(self.regions, remote.regions, lo, re, coalesced, split_layers),
                    plan_slots(self.regions, remote.regions, local_slot, remote_slot))

    def poll(self, pending: PendingRead) -> bool:
        """True once the READ is done (handle released). Raises a typed error on ERR or past the deadline."""
        if pending.event is not None:
            return self._poll_copy(pending)
        if pending.handle is None:
            if pending.state == "DONE" and pending.notify:  # a read with nothing to move is still announced
                pending.notify = False
                self.notify(pending.peer, pending.request_id)
            return True
        if pending.state == "PROC":
            try:
                pending.state = self._xfer_state(pending)
            except Exception as e:
                pending.state = f"ERR ({type(e).__name__}: {e})"
        if pending.state == "DONE":
            self._release(pending)
            if pending.notify:
                try:
                    self.notify(pending.peer, pending.request_id)
                except Exception as e:
                    self.stats.failures += 1
                    raise TransferFailed(f"notifying {pending.peer!r} of the read of {pending.request_id!r}: "
                                         f"{type(e).__name__}: {e}", request_id=pending.request_id,
                                         peer=pending.peer) from e
            self.stats.transfers += 1
            self.stats.bytes += pending.plan.num_bytes
            self.stats.seconds += time.monotonic() - pending.started
            return True
        if pending.state != "PROC":
            self._fail(pending)
            raise TransferFailed(f"READ of {pending.request_id!r} from {pending.peer!r} failed: {pending.state}",
                                 request_id=pending.request_id, peer=pending.peer)
        if time.monotonic() > pending.deadline:
            self._fail(pending)
            raise TransferTimeout(f"READ of {pending.request_id!r} from {pending.peer!r} not done after "
                                  f"{pending.deadline - pending.started:.1f} s",
                                  request_id=pending.request_id, peer=pending.peer)
        return False

    def _xfer_state(self, pending: PendingRead) -> str:
        """The read's NIXL state: the state slot's READ first (released once done), then the blocks'."""
        if pending.slot_handle is not None:
            state = self._agent.check_xfer_state(pending.slot_handle)
            if state != "DONE":
                return state
            handle, pending.slot_handle = pending.slot_handle, None
            self._agent.release_xfer_handle(handle)
        while pending.more:
            state = self._agent.check_xfer_state(pending.more[-1])
            if state != "DONE":
                return state
            self._agent.release_xfer_handle(pending.more.pop())
        return self._agent.check_xfer_state(pending.handle)

    def _poll_copy(self, pending: PendingRead) -> bool:
        """poll() of a CUDA IPC copy: once its event completed, the holder gets the READ's notification."""
        if pending.state == "DONE":
            return True
        if not pending.event.query():
            if time.monotonic() <= pending.deadline:
                return False
            # A copy cannot be called back: let it land before the caller frees (and reuses) its blocks.
            pending.event.synchronize()
            pending.state = "TIMEOUT"
            self.stats.failures += 1
            raise TransferTimeout(f"CUDA IPC read of {pending.request_id!r} from {pending.peer!r} not done after "
                                  f"{pending.deadline - pending.started:.1f} s",
                                  request_id=pending.request_id, peer=pending.peer)
        pending.state = "DONE"
        try:
            self.notify(pending.peer, pending.request_id)
        except Exception as e:
            self.stats.failures += 1
            raise TransferFailed(f"notifying {pending.peer!r} of the read of {pending.request_id!r}: "
                                 f"{type(e).__name__}: {e}", request_id=pending.request_id, peer=pending.peer) from e
        self.stats.transfers += 1
        self.stats.bytes += pending.plan.num_bytes
        self.stats.seconds += time.monotonic() - pending.started
        return True

    def notify(self, peer: str, request_id: str) -> None:
        """Tell a handshaken peer that `request_id` was read (what a CUDA IPC copy sends when it completes)."""
        if peer not in self._peers:
            raise PeerUnreachable(f"no handshake with {peer!r} yet", request_id=request_id, peer=peer)
        self._agent.send_notif(self._peers[peer][0], request_id.encode())

    def wait(self, pending: PendingRead) -> None:
        """Block until the READ is done, or raise `TransferFailed` / `TransferTimeout` by its deadline.

        Spins for the first milliseconds, because a large READ over NVLink takes about a millisecond and even a
        short sleep between polls cuts its bandwidth. Then it backs off. Each spin
        turn yields the GIL (`sleep(0)`): on a decode node this runs beside the engine thread, which would
        otherwise wait up to the interpreter's switch interval (5 ms) per turn for its next step's host work.
        """
        spin_until = time.monotonic() + SPIN_SECONDS
        while not self.poll(pending):
            time.sleep(0 if time.monotonic() <= spin_until else 0.0002)

    def read(self, request_id: str, peer: str, local_blocks: list[int], remote_blocks: list[int],
             local_slot: int, remote_slot: int, timeout: float = DEFAULT_TIMEOUT_S, coalesced: bool = True) -> None:
        self.wait(self.start_read(request_id, peer, local_blocks, remote_blocks, local_slot, remote_slot,
                                  timeout, coalesced))

    def _fail(self, pending: PendingRead) -> None:
        self.stats.failures += 1
        self._release(pending)

    def _release(self, pending: PendingRead) -> None:
        handles = [h for h in (pending.handle, pending.slot_handle, *pending.more) if h is not None]
        pending.handle = pending.slot_handle = None
        pending.more = []
        failed = None
        for handle in handles:
            try:
                self._agent.release_xfer_handle(handle)
            except Exception as e:
                failed = failed or e
        if failed is not None:
            # A handle NIXL refuses to release is reported, not leaked silently.
            raise TransferError(f"releasing the READ handle of {pending.request_id!r}: {failed}",
                                request_id=pending.request_id, peer=pending.peer) from failed

    # ---- prefill side: notifications ----------------------------------------------------------------
    def notifications(self) -> list[str]:
        """Request ids whose READ a peer completed since the last call."""
        out: list[str] = []
        for msgs in self._agent.get_new_notifs().values():
            out.extend(m.decode() for m in msgs)
        return out

    def close(self) -> None:
        for engine_id in list(self._peers):
            self.forget(engine_id)
        if self._reg is not None:
            self._agent.deregister_memory(self._reg)
            self._reg = None
