"""Killed and restarted nodes under load, with real processes (tiny model, 1 prefill + 2 decode nodes, loopback).

A decode node and the prefill node killed together mid-load: requests that had streamed nothing from the decode node
are retried on the other one, those that had streamed tokens end with UNAVAILABLE at once, and every prompt is
prefilled on its decode node meanwhile. Restarted on their ports, both rejoin rotation, and transfers resume with no
fallbacks: the restarted decode node's new NIXL agent handshakes with the prefill node, and the decode node that lived
on drops the metadata it cached of the prefill node's old agent and handshakes with its new one (same engine id). No
request waits for its deadline and nothing leaks.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from baton.cli.cluster import Cluster
from baton.engine.make_model import make_model
from tests.node_faults import ENGINE_ARGS, all_free, node_metric, steady_load, wait_for_health, waits_after

# A killed node's connections close at once: its requests are retried or ended about as fast as they are answered.
ENDED_WITHIN_S = 5.0
# A restarted node loads its model again before it answers.
RESTART_S = 45.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = tmp_path_factory.mktemp("restart") / "tiny"
    make_model(model, preset="tiny", seed=31, progress=False)
    with Cluster(str(model), prefill_workers=1, decode_workers=2, engine_args=ENGINE_ARGS,
                 log_dir=str(tmp_path_factory.mktemp("restart-logs"))) as c:
        yield c


def _transfers(cluster: Cluster) -> list[tuple[float, float]]:
    """(READs completed, pulls that fell back to a local prefill) of every decode node."""
    return [(node_metric(cluster, a, "baton_node_transfers_total"),
             node_metric(cluster, a, "baton_node_transfer_fallbacks_total")) for a in cluster.decode_addrs]


def test_killed_nodes_restart_on_their_ports_rejoin_and_transfer_again(cluster):
    router = cluster.router_addr

    async def go():
        stop = asyncio.Event()
        load = asyncio.create_task(steady_load(router, stop, loops=6))
        await asyncio.sleep(1.5)
        killed_at = time.monotonic()
        for name in ("decode-0", "prefill-0"):
            await asyncio.to_thread(cluster.kill, name)
        await wait_for_health(router, 0, 1, timeout=ENDED_WITHIN_S)
        for name in ("decode-0", "prefill-0"):
            await asyncio.to_thread(cluster.respawn, name)
        await wait_for_health(router, 1, 2, timeout=RESTART_S)
        rejoined_at = time.monotonic()
        before = await asyncio.to_thread(_transfers, cluster)
        await asyncio.sleep(2.5)
        stop.set()
        outcomes = await load
        after = await asyncio.to_thread(_transfers, cluster)
        return killed_at, rejoined_at, outcomes, before, after

    killed_at, rejoined_at, outcomes, before, after = asyncio.run(asyncio.wait_for(go(), 150))
    # Both decode nodes pulled from the restarted prefill node, not once in vain.
    for (t0, f0), (t1, f1) in zip(before, after, strict=True):
        assert t1 > t0 and f1 == f0, (before, after)
    waits = waits_after(outcomes, killed_at)
    assert waits and max(waits) < ENDED_WITHIN_S, sorted(waits)[-5:]
    # Only streams that had sent tokens from the killed decode node fail, saying so; nothing fails once back.
    for o in outcomes:
        if o.status != "OK":
            assert o.status == "UNAVAILABLE" and o.tokens > 0 and "tokens were streamed" in o.details, o
            assert killed_at < o.ended < rejoined_at, o
    free, loads = all_free(cluster)
    assert free, loads
