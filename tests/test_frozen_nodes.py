"""Frozen nodes under load, with real processes (tiny model, 2 prefill + 2 decode nodes, loopback): a node stopped
by SIGSTOP is noticed within seconds (the router's keepalive pings go unanswered), its requests that had streamed
nothing are retried on another node and those that had streamed tokens end with UNAVAILABLE — none waits for the
freeze to end, let alone for its deadline — and once continued it is back in rotation. Nothing leaks on any node.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from baton.cli.cluster import Cluster
from baton.engine.make_model import make_model
from tests.node_faults import (
    ENGINE,
    ENGINE_ARGS,
    all_free,
    burst,
    frozen,
    metric,
    steady_load,
    wait_for_health,
    waits_after,
)

FREEZE_S = 7.0
# How long a request may still run once its node froze (or once it started, if later): a keepalive ping that goes
# unanswered (`proto/keepalive.py`), then the retry elsewhere, on a busy two-core machine. Short of FREEZE_S: none
# waits for the freeze to end.
NOTICED_WITHIN_S = 6.0
# Requests sent at once right after a node's freeze (beside the steady load's 8 in flight), short ones: the retried
# ones end soon. Twice a node's state slots: the other node cannot look the emptier one for all of them, so some are
# sent to the frozen node before the router notices whatever its load looked like when it froze.
BURST = 2 * ENGINE["max_num_seqs"]
# Decode nodes give up a READ from a frozen prefill node after this long and prefill locally.
READ_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = tmp_path_factory.mktemp("frozen") / "tiny"
    make_model(model, preset="tiny", seed=31, progress=False)
    with Cluster(str(model), prefill_workers=2, decode_workers=2, engine_args=ENGINE_ARGS,
                 decode_args=("--read-timeout", str(READ_TIMEOUT_S)),
                 log_dir=str(tmp_path_factory.mktemp("frozen-logs"))) as c:
        yield c


def _retries(cluster: Cluster, stage: str) -> float:
    return metric(cluster.router_http_url + "/metrics", "baton_router_retries_total", {"stage": stage})


def _freeze_under_load(cluster: Cluster, name: str, healthy_while_frozen: tuple[int, int], extra_requests: int = 0):
    """Runs a steady load, freezes `name` for FREEZE_S mid-way (sending `extra_requests` at once right after), checks
    the router's health while frozen and once continued; returns when it froze and how every request ended."""
    async def go():
        stop = asyncio.Event()
        load = asyncio.create_task(steady_load(cluster.router_addr, stop))
        await asyncio.sleep(1.5)
        frozen_at = time.monotonic()
        with frozen(cluster, name):
            # New requests before the router notices: once the other node holds more than the frozen one's stuck
            # requests, some are sent to the frozen node, so that some requests there have streamed nothing
            # (without them, whether any had depends on the moment of the freeze).
            extra = asyncio.create_task(burst(cluster.router_addr, extra_requests, max_tokens=4))
            await wait_for_health(cluster.router_addr, *healthy_while_frozen, timeout=NOTICED_WITHIN_S)
            await asyncio.sleep(frozen_at + FREEZE_S - time.monotonic())
        # Continued: back in rotation as soon as it answers a Load poll.
        await wait_for_health(cluster.router_addr, 2, 2, timeout=5.0)
        await asyncio.sleep(0.5)
        stop.set()
        return frozen_at, await load + await extra

    return asyncio.run(asyncio.wait_for(go(), 60))


def _check_nothing_waited(outcomes, frozen_at):
    waits = waits_after(outcomes, frozen_at)
    assert waits and max(waits) < NOTICED_WITHIN_S, sorted(waits)[-5:]
    assert all(o.status in ("OK", "UNAVAILABLE") for o in outcomes), {o.status for o in outcomes}


def test_a_frozen_decode_node_is_routed_around_and_rejoins(cluster):
    retries_before = _retries(cluster, "decode")
    frozen_at, outcomes = _freeze_under_load(cluster, "decode-0", (2, 1), BURST)
    _check_nothing_waited(outcomes, frozen_at)
    # Only streams that had sent tokens from the frozen node fail, saying so; the others were retried.
    for o in outcomes:
        if o.status != "OK":
            assert o.tokens > 0 and f"after {o.tokens} tokens were streamed" in o.details, o
    assert _retries(cluster, "decode") > retries_before
    free, loads = all_free(cluster)
    assert free, loads


def test_a_frozen_prefill_node_is_routed_around_and_rejoins(cluster):
    retries_before = _retries(cluster, "prefill")
    # The burst sends new Prefill calls to the frozen node before the router notices: they too are retried at once.
    frozen_at, outcomes = _freeze_under_load(cluster, "prefill-0", (1, 2), BURST)
    _check_nothing_waited(outcomes, frozen_at)
    # Nothing was streamed from a prefill node: every request is answered, prefilled elsewhere.
    assert all(o.status == "OK" for o in outcomes), [o for o in outcomes if o.status != "OK"][:3]
    assert _retries(cluster, "prefill") > retries_before
    free, loads = all_free(cluster)
    assert free, loads
