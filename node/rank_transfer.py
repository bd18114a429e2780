"""Transfers at a node of several tensor-parallel ranks: each rank registers its own pools (its shard of every
layer) with a NIXL agent of its own; rank 0 publishes all of them on the side channel and, on a decode node,
has every rank read its shard of a request from the peer ranks that hold it (`transfer.sharded_read`).

Rank 0 drives the other ranks' agents over a Unix socket it listens on before they start (`RankLinks`); each of
them serves its agent on a thread beside its engine (`serve_rank`, attached through `follower_main --attach`). A
read is sent to every rank, rank 0 reads its own shard meanwhile, and the peer is notified (its lease freed) only
once every rank's read is done. A rank reads only once it has applied the command that reserved the blocks
(`follower.Applied`): a step of that rank may otherwise still be using them for the request that held them.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import tempfile
import threading
import time
from pathlib import Path

import msgspec

from baton.engine.llm_engine import LLMEngine
from baton.engine.parallel.follower import Applied
from baton.transfer.agent import DEFAULT_TIMEOUT_S, TransferAgent
from baton.transfer.errors import PeerUnreachable, TransferError, TransferFailed, TransferTimeout
from baton.transfer.framing import recv_frame, send_frame
from baton.transfer.metadata import AgentMetadata, RankAgent
from baton.transfer.shard_map import PoolShards, pool_shards

log = logging.getLogger("baton.transfer")
ATTACH = "baton.node.rank_transfer:serve_rank"
# How long rank 0 waits for the other ranks' agents once its own is up (they built their engines alongside it).
HELLO_TIMEOUT_S = 300.0
# Past a read's own deadline: how long rank 0 waits for another rank's answer (that rank waits for the reserving
# command, then reads within the same deadline).
REPLY_MARGIN_S = 5.0


class Hello(msgspec.Struct, tag=True):
    rank: RankAgent


class Connect(msgspec.Struct, tag=True):
    metadata: AgentMetadata


class Read(msgspec.Struct, tag=True):
    request_id: str
    peer: str
    local_blocks: list[int]
    remote_blocks: list[int]
    local_slot: int
    remote_slot: int
    timeout: float
    after: int  # rank 0's commands the rank must have applied first (the one that reserved the blocks included)


class Forget(msgspec.Struct, tag=True):
    peer: str


class Done(msgspec.Struct, tag=True):
    # What this rank's read moved, so that the node's transfer metrics count every rank's share.
    bytes: int = 0
    descriptors: int = 0


class Failed(msgspec.Struct, tag=True):
    kind: str  # "unreachable" | "timeout" | "failed" | "error"
    message: str


class FollowerArgs(msgspec.Struct, frozen=True):
    socket_path: str
    engine_id: str
    progress_delay_us: int


Command = Connect | Read | Forget
_commands = msgspec.msgpack.Decoder(Command)
_replies = msgspec.msgpack.Decoder(Done | Failed)
_hello = msgspec.msgpack.Decoder(Hello)
_ERRORS: dict[str, type[TransferError]] = {"unreachable": PeerUnreachable, "timeout": TransferTimeout,
                                           "failed": TransferFailed}


def _send(sock: socket.socket, msg: msgspec.Struct) -> None:
    send_frame(sock, msgspec.msgpack.encode(msg))


def _recv(sock: socket.socket) -> bytes:
    return recv_frame(sock, "rank transfer link")


def _failed(e: Exception) -> Failed:
    kind = next((k for k, cls in _ERRORS.items() if isinstance(e, cls)), "error")
    return Failed(kind, str(e))


def engine_pool_shards(engine: LLMEngine) -> dict[str, PoolShards]:
    """How the engine's ranks split each travelling pool."""
    return pool_shards(engine.pools.by_name(), engine.model.state_spec(engine.shard_config),
                       engine.model_config.num_key_value_heads, engine.config.tensor_parallel_size)


def rank_agent(engine: LLMEngine, engine_id: str, rank: int, **kwargs) -> TransferAgent:
    """A rank's agent over its own pools."""
    return TransferAgent(engine_id, engine.model_config, engine.pools.by_name(), engine.config.block_size,
                         num_speculative_tokens=engine.config.num_speculative_tokens,
                         shards=engine_pool_shards(engine), tp_rank=rank, **kwargs)


# ---- ranks 1..N-1 ----------------------------------------------------------------------------------------------

def serve_rank(engine: LLMEngine, rank: int, arg: str, applied: Applied) -> None:
    """`follower_main --attach`: this rank's agent, announced to rank 0, then served on a daemon thread."""
    args = msgspec.json.decode(arg, type=FollowerArgs)
    agent = rank_agent(engine, args.engine_id, rank, progress_delay_us=args.progress_delay_us)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(args.socket_path)
    _send(sock, Hello(agent.rank_agent()))
    threading.Thread(target=_serve, args=(agent, sock, applied), name=f"baton-rank-transfer-{rank}",
                     daemon=True).start()


def _serve(agent: TransferAgent, sock: socket.socket, applied: Applied) -> None:
    with contextlib.closing(sock):
        while True:
            try:
                cmd = _commands.decode(_recv(sock))
            except (ConnectionError, OSError):
                return  # rank 0 is gone: this process ends with it
            try:
                moved, descriptors = agent.stats.bytes, agent.stats.descriptors
                _apply(agent, cmd, applied)
                reply: Done | Failed = Done(agent.stats.bytes - moved, agent.stats.descriptors - descriptors)
            except TransferError as e:
                reply = _failed(e)
            except Exception as e:  # rank 0 gets the error instead of a rank that stopped answering
                log.exception("rank transfer command failed")
                reply = Failed("error", f"{type(e).__name__}: {e}")
            _send(sock, reply)


def _apply(agent: TransferAgent, cmd: Command, applied: Applied) -> None:
    match cmd:
        case Connect():
            agent.connect(cmd.metadata)
        case Read():
            if not applied.wait_for(cmd.after, cmd.timeout):
                raise TransferTimeout(f"rank {agent.tp_rank}: rank 0's command {cmd.after} (reserving the blocks "
                                      f"of {cmd.request_id!r}) not applied after {cmd.timeout:g} s",
                                      request_id=cmd.request_id, peer=cmd.peer)
            agent.read(cmd.request_id, cmd.peer, cmd.local_blocks, cmd.remote_blocks, cmd.local_slot,
                       cmd.remote_slot, cmd.timeout)
        case Forget():
            agent.forget(cmd.peer)


# ---- rank 0 ----------------------------------------------------------------------------------------------------

class RankLinks:
    """Rank 0's end: a Unix socket the other ranks connect to once their agents are up."""

    def __init__(self, tp: int) -> None:
        self.tp = tp
        self._dir = tempfile.mkdtemp(prefix="baton-rank-transfer-")
        self.path = str(Path(self._dir) / "links")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen(tp)
        self._socks: list[socket.socket] = []
        self.ranks: list[RankAgent] = []
        # Set once a rank missed an answer: its later answers would be taken for those of later commands, so the
        # node reads no more (its requests prefill locally instead).
        self.broken = ""

    def attach(self, engine_id: str, progress_delay_us: int) -> tuple[str, str]:
        """What `start_engine` passes the other ranks."""
        args = FollowerArgs(self.path, engine_id, progress_delay_us)
        return ATTACH, msgspec.json.encode(args).decode()

    def accept(self, timeout: float = HELLO_TIMEOUT_S) -> None:
        """Wait for ranks 1..N-1 to announce their agents."""
        deadline = time.monotonic() + timeout
        by_rank: dict[int, tuple[socket.socket, RankAgent]] = {}
        while len(by_rank) < self.tp - 1:
            self._listener.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                raise RuntimeError(f"tensor-parallel ranks' transfer agents: expected {self.tp - 1} within "
                                   f"{timeout:g} s, got {len(by_rank)}") from None
            sock.settimeout(None)
            hello = _hello.decode(_recv(sock))
            by_rank[hello.rank.tp_rank] = (sock, hello.rank)
        if sorted(by_rank) != list(range(1, self.tp)):
            raise RuntimeError(f"tensor-parallel ranks' transfer agents: expected ranks 1..{self.tp - 1}, got "
                               f"{sorted(by_rank)}")
        self._socks = [by_rank[r][0] for r in sorted(by_rank)]
        self.ranks = [by_rank[r][1] for r in sorted(by_rank)]

    def send(self, cmd: Command) -> None:
        if self.broken:
            raise TransferError(f"tensor-parallel ranks' transfer links are out of step: {self.broken}")
        try:
            for sock in self._socks:
                _send(sock, cmd)
        except OSError as e:
            self.broken = f"sending to a rank: {type(e).__name__}: {e}"
            raise TransferError(f"tensor-parallel ranks' transfer links: {self.broken}") from e

    def replies(self, timeout: float) -> list[Done | Failed]:
        out: list[Done | Failed] = []
        deadline = time.monotonic() + timeout
        for r, sock in enumerate(self._socks, start=1):
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                out.append(_replies.decode(_recv(sock)))
            except (OSError, ConnectionError) as e:
                self.broken = f"rank {r} did not answer: {type(e).__name__}: {e}"
                out.append(Failed("error", self.broken))
            finally:
                sock.settimeout(None)
        return out

    def close(self) -> None:
        for sock in self._socks:
            with contextlib.suppress(OSError):
                sock.close()
        self._listener.close()
        with contextlib.suppress(OSError):
            Path(self.path).unlink()
            Path(self._dir).rmdir()


def _raise_first(replies: list[Done | Failed], request_id: str | None, peer: str) -> None:
    for rank, reply in enumerate(replies, start=1):
        if isinstance(reply, Failed):
            cls = _ERRORS.get(reply.kind, TransferError)
            raise cls(f"tensor-parallel rank {rank}: {reply.message}", request_id=request_id, peer=peer)


class RankedTransfer:
    """A node's transfers over every rank's agent, with rank 0's agent's interface (what `Puller` and the
    prefill side use)."""

    def __init__(self, agent: TransferAgent, links: RankLinks) -> None:
        self.agent = agent
        self.links = links
        agent.with_ranks((agent.rank_agent(), *links.ranks))

    @property
    def engine_id(self) -> str:
        return self.agent.engine_id

    @property
    def agent_name(self) -> str:
        return self.agent.agent_name

    @property
    def metadata(self) -> AgentMetadata:
        return self.agent.metadata

    @property
    def stats(self):
        return self.agent.stats

    def peer_agent_name(self, engine_id: str) -> str | None:
        return self.agent.peer_agent_name(engine_id)

    def connect(self, remote: AgentMetadata) -> None:
        """Every rank's handshake with the peer's ranks it reads from."""
        if self.agent.peer_agent_name(remote.engine_id) == remote.agent_name:
            return
        self.links.send(Connect(remote))
        error: TransferError | None = None
        try:
            self.agent.connect(remote)
        except TransferError as e:
            error = e
        replies = self.links.replies(DEFAULT_TIMEOUT_S + REPLY_MARGIN_S)
        try:
            if error is not None:
                raise error
            _raise_first(replies, None, remote.engine_id)
        except TransferError:
            self.forget(remote.engine_id)
            raise

    def read(self, request_id: str, peer: str, local_blocks: list[int], remote_blocks: list[int], local_slot: int,
             remote_slot: int, timeout: float = DEFAULT_TIMEOUT_S, after: int = 0) -> None:
        """Every rank reads its shard; the peer is notified once all have. `after`: the commands rank 0 had sent
        when it reserved the blocks (`LeaderEngine.commands_sent`)."""
        self.links.send(Read(request_id, peer, list(local_blocks), list(remote_blocks), local_slot, remote_slot,
                             timeout, after))
        error: TransferError | None = None
        stats = self.agent.stats
        started, own_seconds = time.monotonic(), stats.seconds
        try:
            self.agent.read(request_id, peer, local_blocks, remote_blocks, local_slot, remote_slot, timeout)
        except TransferError as e:
            error = e
        # Every rank's answer, even after rank 0's failure: the caller frees the blocks once this returns.
        replies = self.links.replies(2 * timeout + REPLY_MARGIN_S)
        if error is not None:
            raise error
        _raise_first(replies, request_id, peer)
        # The node's read is every rank's: their bytes and descriptors count, and it lasts until the last answer.
        stats.bytes += sum(r.bytes for r in replies if isinstance(r, Done))
        stats.descriptors += sum(r.descriptors for r in replies if isinstance(r, Done))
        stats.seconds += time.monotonic() - started - (stats.seconds - own_seconds)
        try:
            self.agent.notify(peer, request_id)
        except Exception as e:
            self.agent.stats.failures += 1
            raise TransferFailed(f"notifying {peer!r} of the read of {request_id!r}: {type(e).__name__}: {e}",
                                 request_id=request_id, peer=peer) from e

    def forget(self, engine_id: str) -> None:
        self.links.send(Forget(engine_id))
        self.agent.forget(engine_id)
        self.links.replies(REPLY_MARGIN_S)

    def notifications(self) -> list[str]:
        return self.agent.notifications()

    def close(self) -> None:
        self.links.close()
        self.agent.close()


def node_transfer(engine: LLMEngine, engine_id: str, links: RankLinks | None,
                  **kwargs) -> TransferAgent | RankedTransfer:
    """A node's transfers: rank 0's agent alone at one rank; at several, over every rank's (they announce
    theirs now). `kwargs`: `TransferAgent`'s options."""
    agent = rank_agent(engine, engine_id, 0, **kwargs)
    if links is None:
        return agent
    try:
        links.accept()
    except BaseException:
        agent.close()
        links.close()
        raise
    return RankedTransfer(agent, links)
