"""Side channel and handshake checks: typed frames, lease renewal, bounded failures, compatibility."""

import socket
import threading
import time

import pytest
import torch

from baton.engine.cache_pools import CachePools, plan_cache
from baton.engine.config import ModelConfig
from baton.engine.engine_config import EngineConfig
from baton.engine.make_model import build_config
from baton.transfer.errors import IncompatiblePeer, LeaseExpired, PeerUnreachable
from baton.transfer.layout import RegionLayout
from baton.transfer.lease import LeaseTable
from baton.transfer.metadata import AgentMetadata, check_compatible, compat_hash, make_compat
from baton.transfer.side_channel import SideChannelClient, SideChannelServer


def metadata(engine_id="p0", block_size=16, overrides=None, ssm_dtype=torch.float32, spec=0):
    cfg = ModelConfig.from_hf_dict(build_config("tiny", overrides=overrides))
    ecfg = EngineConfig(block_size=block_size, max_num_seqs=4, num_kv_blocks=8)
    pools = CachePools(cfg, plan_cache(cfg, ecfg, torch.float32, ssm_dtype), block_size, torch.float32,
                       ssm_dtype, "cpu")
    regions = {name: RegionLayout.of(name, t) for name, t in pools.by_name().items()}
    compat = make_compat(cfg, regions, block_size, spec)
    return AgentMetadata(engine_id=engine_id, agent_name=f"agent-{engine_id}", nixl_metadata=b"\x00nixl",
                         compat=compat, compat_hash=compat_hash(compat), regions=regions)


@pytest.fixture
def server():
    meta = metadata()
    leases = LeaseTable(lease_seconds=5)
    leases.hold("r1", [1, 2], 0, 30)

    def renew(rid, seconds):
        return leases.renew(rid, seconds) - leases.clock()

    srv = SideChannelServer(lambda: meta, renew)
    yield srv, meta
    srv.close()


def test_handshake_round_trip_and_renewal(server):
    srv, meta = server
    client = SideChannelClient(*srv.address)
    assert client.metadata() == meta
    assert 9.0 < client.renew("r1", 10.0) <= 10.0
    with pytest.raises(LeaseExpired):
        client.renew("unknown")


def test_unreachable_peer_fails_fast():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once we leave: nobody listens there
    t0 = time.monotonic()
    with pytest.raises(PeerUnreachable):
        SideChannelClient("127.0.0.1", port, timeout=1.0).metadata()
    assert time.monotonic() - t0 < 1.5


def test_silent_peer_times_out_within_the_deadline():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    held = []
    threading.Thread(target=lambda: held.append(listener.accept()), daemon=True).start()
    t0 = time.monotonic()
    with pytest.raises(PeerUnreachable, match="timed out"):
        SideChannelClient(*listener.getsockname(), timeout=0.5).metadata()
    assert time.monotonic() - t0 < 1.5
    listener.close()


def test_compatible_peers_pass():
    check_compatible(metadata("d0"), metadata("p0"))


@pytest.mark.parametrize("remote,field", [
    (lambda: metadata(block_size=32), "block_size"),
    (lambda: metadata(overrides={"hybrid_override_pattern": "M*M-M*-M"}), "model_fingerprint"),
    (lambda: metadata(ssm_dtype=torch.bfloat16), "ssm_dtype"),
    (lambda: metadata(spec=2), "num_speculative_tokens"),
])
def test_mismatch_is_refused_naming_the_field(remote, field):
    with pytest.raises(IncompatiblePeer, match=f"'{field}'") as e:
        check_compatible(metadata("d0"), remote())
    assert e.value.field == field


def test_forged_hash_is_refused():
    good = metadata()
    forged = AgentMetadata(**{**{f: getattr(good, f) for f in good.__struct_fields__}, "compat_hash": "0" * 16})
    with pytest.raises(IncompatiblePeer, match="compat_hash"):
        check_compatible(metadata("d0"), forged)
