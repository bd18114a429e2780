"""Side channel and handshake checks: typed frames, lease renewal, bounded failures, compatibility."""

import socket
import ssl
import threading
import time

import pytest
import torch

from baton.engine.cache_pools import CachePools, plan_cache
from baton.engine.config import ModelConfig
from baton.engine.engine_config import EngineConfig
from baton.engine.make_model import build_config
from baton.engine.model import NemotronHForCausalLM
from baton.engine.parallel.shard_config import shard_config
from baton.proto.auth import ClusterCredential
from baton.transfer.errors import (
    IncompatiblePeer,
    LeaseExpired,
    PeerUnauthenticated,
    PeerUnreachable,
    TransferError,
)
from baton.transfer.layout import RegionLayout
from baton.transfer.lease import LeaseTable
from baton.transfer.metadata import AgentMetadata, RankAgent, check_compatible, compat_hash, make_compat
from baton.transfer.shard_map import pool_shards
from baton.transfer.side_channel import SideChannelClient, SideChannelServer


def metadata(engine_id="p0", block_size=16, overrides=None, ssm_dtype=torch.float32, spec=0, tp=1, ranks=None,
             kv_dtype=None):
    """A node's metadata as rank 0 publishes it: its pools at `tp` ranks' shapes, `ranks` rank agents (tp)."""
    full = ModelConfig.from_hf_dict(build_config("tiny", overrides=overrides))
    cfg = shard_config(full, tp)
    ecfg = EngineConfig(block_size=block_size, max_num_seqs=4, num_kv_blocks=8)
    state = NemotronHForCausalLM.state_spec(cfg)
    pools = CachePools(cfg, plan_cache(cfg, state, ecfg, torch.float32, ssm_dtype, kv_dtype), block_size,
                       torch.float32, ssm_dtype, "cpu", kv_dtype)
    regions = {name: RegionLayout.of(name, t) for name, t in pools.by_name().items()}
    compat = make_compat(full, regions, block_size, spec, pool_shards(pools.by_name(), state, full.num_key_value_heads,
                                                                      tp))
    agents = tuple(RankAgent(r, f"agent-{engine_id}-{r}", b"\x00nixl", regions) for r in range(ranks or tp))
    return AgentMetadata(engine_id=engine_id, agent_name=f"agent-{engine_id}-0", nixl_metadata=b"\x00nixl",
                         compat=compat, compat_hash=compat_hash(compat), regions=regions,
                         ranks=agents if tp > 1 or ranks else ())


CREDENTIAL = ClusterCredential.generate()


@pytest.fixture
def server():
    meta = metadata()
    leases = LeaseTable(lease_seconds=5)
    lease = leases.hold("r1", [1, 2], 0, 30)

    def renew(rid, lease_id, seconds):
        return leases.renew(rid, lease_id, seconds) - leases.clock()

    srv = SideChannelServer(lambda: meta, renew, credential=CREDENTIAL)
    yield srv, meta, lease
    srv.close()


def test_handshake_round_trip_and_renewal(server):
    srv, meta, lease = server
    client = SideChannelClient(*srv.address, credential=CREDENTIAL)
    assert client.metadata() == meta
    assert 9.0 < client.renew("r1", lease.lease_id, 10.0) <= 10.0
    with pytest.raises(LeaseExpired):
        client.renew("unknown", lease.lease_id)
    # The request id alone does not renew: the lease id from its handle must come with it.
    with pytest.raises(LeaseExpired):
        client.renew("r1", "0" * 32)


def test_side_channel_answers_nothing_without_the_cluster_token(server):
    srv, _, lease = server
    for client in (SideChannelClient(*srv.address), SideChannelClient(*srv.address,
                                                                       credential=ClusterCredential.generate())):
        with pytest.raises(PeerUnauthenticated):
            client.metadata()
        with pytest.raises(PeerUnauthenticated):
            client.renew("r1", lease.lease_id, 10.0)


@pytest.mark.parametrize("seconds", [1e9, float("nan"), float("inf"), -1.0, 0.0])
def test_renewal_seconds_must_be_finite_and_bounded(server, seconds):
    srv, _, lease = server
    client = SideChannelClient(*srv.address, credential=CREDENTIAL)
    with pytest.raises(TransferError, match="seconds: expected"):
        client.renew("r1", lease.lease_id, seconds)
    # The lease kept its expiry: still renewable with a sane time.
    assert 0 < client.renew("r1", lease.lease_id, 1.0) <= 1.0


def test_side_channel_over_tls(tmp_path):
    from tests.tls_certs import write_certs

    ca, cert, key = write_certs(tmp_path)
    meta = metadata()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    srv = SideChannelServer(lambda: meta, lambda *a: 1.0, credential=CREDENTIAL, ssl_context=server_ctx)
    try:
        tls = SideChannelClient(*srv.address, credential=CREDENTIAL, ssl_context=ssl.create_default_context(cafile=ca))
        assert tls.metadata() == meta
        # A plain-text caller gets nothing from a TLS side channel.
        with pytest.raises(PeerUnreachable):
            SideChannelClient(*srv.address, timeout=1.0, credential=CREDENTIAL).metadata()
    finally:
        srv.close()


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
    (lambda: metadata(ssm_dtype=torch.bfloat16, tp=2), "ssm_dtype"),
    (lambda: metadata(tp=2, ranks=1), "ranks"),
    (lambda: metadata(kv_dtype=torch.float8_e4m3fn), "kv_dtype"),
])
def test_mismatch_is_refused_naming_the_field(remote, field):
    with pytest.raises(IncompatiblePeer, match=f"'{field}'") as e:
        check_compatible(metadata("d0"), remote())
    assert e.value.field == field


@pytest.mark.parametrize("mine,theirs", [(1, 2), (2, 1), (2, 4), (2, 2)])
def test_nodes_of_different_tensor_parallel_sizes_are_compatible(mine, theirs):
    """The TP size is not compared: each side's whole-model layouts are, and each rank reads its shard (#50)."""
    four = {"n_groups": 4}  # Mamba2 groups split over four ranks
    local, remote = metadata("d0", tp=mine, overrides=four), metadata(tp=theirs, overrides=four)
    check_compatible(local, remote)
    assert len(remote.rank_agents()) == theirs and remote.compat.tp_size == theirs
    assert local.compat.shards["kv"].parts == remote.compat.shards["kv"].parts


def test_forged_hash_is_refused():
    good = metadata()
    forged = AgentMetadata(**{**{f: getattr(good, f) for f in good.__struct_fields__}, "compat_hash": "0" * 16})
    with pytest.raises(IncompatiblePeer, match="compat_hash"):
        check_compatible(metadata("d0"), forged)
