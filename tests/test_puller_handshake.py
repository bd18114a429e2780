"""The decode side's handshake with a prefill node that accepts connections but does not answer (a stopped
process: its listening socket still takes them): the pull gives up within its READ timeout, not the side
channel's longer default, and the transfer thread stays free for other requests' READs meanwhile."""

import asyncio
import socket
import time

import pytest

from baton.decode_node.puller import Puller
from baton.engine.engine_config import EngineConfig
from baton.engine.llm_engine import LLMEngine
from baton.engine.make_model import make_model
from baton.proto.v1 import worker_pb2 as wk
from baton.transfer.agent import TransferAgent
from baton.transfer.errors import PeerUnreachable
from baton.transfer.side_channel import DEFAULT_TIMEOUT_S

READ_TIMEOUT_S = 0.5


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    model = tmp_path_factory.mktemp("handshake") / "tiny"
    make_model(model, preset="tiny", seed=3, progress=False)
    engine = LLMEngine.from_pretrained(model, EngineConfig(block_size=8, max_num_seqs=2, num_kv_blocks=32))
    return TransferAgent("decode-handshake", engine.model_config, engine.pools.by_name(), engine.config.block_size)


def test_a_silent_prefill_node_is_given_up_within_the_read_timeout_and_blocks_no_other_read(agent):
    assert READ_TIMEOUT_S < DEFAULT_TIMEOUT_S / 4
    silent = socket.create_server(("127.0.0.1", 0), backlog=8)  # listens, never accepts or answers
    port = silent.getsockname()[1]
    h = wk.TransferHandle(engine_id="prefill-silent", agent_name="prefill-silent-agent", request_id="r0",
                          side_channel_host="127.0.0.1", side_channel_port=port)
    puller = Puller(agent, thread=None, read_timeout_s=READ_TIMEOUT_S)  # (the handshake needs no engine thread)

    async def main() -> tuple[float, float]:
        t0 = time.monotonic()
        handshake = asyncio.create_task(puller._connect(h))
        await asyncio.sleep(0.05)
        # Another request's work on the transfer thread runs while the handshake waits for its answer.
        await puller._on_nixl(lambda: None)
        other = time.monotonic() - t0
        with pytest.raises(PeerUnreachable, match="side channel"):
            await handshake
        return other, time.monotonic() - t0

    try:
        other, gave_up = asyncio.run(main())
    finally:
        puller.close()
        silent.close()
    assert other < READ_TIMEOUT_S, other
    assert READ_TIMEOUT_S * 0.9 <= gave_up < 2 * READ_TIMEOUT_S, gave_up
    assert agent.peer_agent_name("prefill-silent") is None
