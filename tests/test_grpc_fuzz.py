"""Fuzzing the gRPC surfaces of a real cluster (tiny model; one router, one prefill and one decode node started once
for the module): random messages (out-of-range numbers, long lists, odd unicode) and raw bytes (undecodable, or
decodable with integers too wide for their field) to the router's Generation service and to the nodes' Worker
service. Every call is answered with an expected status, never UNKNOWN or INTERNAL; no process dies; afterwards
no KV block, state slot or lease is held and the router has nothing in flight.

Valid requests are cancelled after their first message (which exercises the abort path too), so each case is
quick; 1,000 cases in all.
"""

from __future__ import annotations

import re
import time
import urllib.request

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from baton.cli.cluster import Cluster
from baton.engine.make_model import make_model
from baton.proto.auth import ClusterCredential
from baton.proto.v1 import generation_pb2 as gen
from baton.proto.v1 import generation_pb2_grpc as gen_grpc
from baton.proto.v1 import worker_pb2 as wk
from baton.proto.v1 import worker_pb2_grpc as wk_grpc
from tests.test_router_service import varint

ENGINE_ARGS = ("--block-size", "8", "--max-num-batched-tokens", "64", "--max-num-seqs", "8",
               "--num-kv-blocks", "256", "--max-model-len", "256")
ROUTER_ARGS = ("--max-stop-ids", "16", "--stream-write-timeout-s", "5")
VOCAB = 512  # the tiny preset's
CALL_TIMEOUT_S = 30.0


def fuzz(examples: int) -> settings:
    """Reproducible runs (derandomized, no example database) over the module's one cluster."""
    return settings(max_examples=examples, deadline=None, database=None, derandomize=True, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


C = grpc.StatusCode
# What the router may answer: served, refused naming a field, or refused by a limit.
ROUTER_CODES = {C.OK, C.INVALID_ARGUMENT, C.RESOURCE_EXHAUSTED}
# A node may also say the method belongs to the other role, or that a handle is not its cluster's.
WORKER_CODES = ROUTER_CODES | {C.UNIMPLEMENTED, C.PERMISSION_DENIED}
# INVALID_ARGUMENT names what was wrong: one of these appears in its details.
FIELDS = re.compile(r"request_id|prompt|token|sampling|max_tokens|temperature|top_p|top_k|seed|stop|handle|request:"
                    r"|expected a serialized|max_model_len|vocab")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = tmp_path_factory.mktemp("fuzz") / "tiny"
    make_model(model, preset="tiny", seed=5, progress=False)
    c = Cluster(str(model), prefill_workers=1, decode_workers=1, engine_args=ENGINE_ARGS, router_args=ROUTER_ARGS,
                log_dir=str(tmp_path_factory.mktemp("logs")))
    c.start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def channels(cluster):
    chans = {name: grpc.insecure_channel(addr) for name, addr in
             (("router", cluster.router_addr), ("prefill", cluster.prefill_addrs[0]),
              ("decode", cluster.decode_addrs[0]))}
    yield chans
    for ch in chans.values():
        ch.close()


def _metadata() -> tuple:
    credential = ClusterCredential.from_sources()
    return credential.grpc_metadata() if credential is not None else ()


def _code(call_first) -> tuple[grpc.StatusCode, str]:
    """Runs `call_first()` (a unary call, or the first read of a stream, which it then cancels)."""
    try:
        call_first()
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return C.OK, ""


def _first_then_cancel(stream) -> None:
    try:
        next(stream, None)
    finally:
        stream.cancel()


def _check(code: grpc.StatusCode, details: str, allowed: set[grpc.StatusCode]) -> None:
    event(code.name)  # (--hypothesis-show-statistics: how the cases were answered)
    assert code in allowed, f"{code.name}: {details}"
    if code == C.INVALID_ARGUMENT:
        assert FIELDS.search(details), f"INVALID_ARGUMENT naming no field: {details}"


# ---- strategies ----------------------------------------------------------------------------------------------
u32 = st.integers(0, 2**32 - 1)
# Mostly ids the model knows, some past its vocabulary, some at the type's edge.
token_id = st.one_of(st.integers(0, VOCAB - 1), st.integers(VOCAB, VOCAB + 8), u32)
token_ids = st.lists(token_id, max_size=300)
request_id = st.one_of(st.text(max_size=24), st.text(min_size=250, max_size=300))
f32 = st.floats(width=32)


@st.composite
def sampling(draw, valid: bool = False) -> gen.SamplingParams:
    """Any values, or (valid) values the router accepts, so that the serving path is exercised as much."""
    if valid:
        ids, strategies = st.lists(st.integers(0, VOCAB - 1), max_size=16), (
            ("max_tokens", st.integers(1, 8)), ("temperature", st.floats(0, 2, width=32)),
            ("top_p", st.floats(0.25, 1, width=32)), ("top_k", st.integers(0, VOCAB)),
            ("seed", st.integers(0, 2**63 - 1)))
    else:
        ids, strategies = st.lists(token_id, max_size=24), (
            ("max_tokens", st.one_of(st.integers(0, 4), u32)), ("temperature", f32), ("top_p", f32),
            ("top_k", st.one_of(st.integers(0, 8), u32)), ("seed", st.integers(0, 2**64 - 1)))
    p = gen.SamplingParams(stop_token_ids=draw(ids), ignore_eos=draw(st.booleans()))
    for name, strategy in strategies:
        if draw(st.booleans()):
            setattr(p, name, draw(strategy))
    return p


@st.composite
def generate_request(draw) -> gen.GenerateRequest:
    valid = draw(st.booleans())
    req = gen.GenerateRequest(request_id=draw(st.text(max_size=24) if valid else request_id),
                              sampling=draw(sampling(valid)))
    kind = draw(st.sampled_from(["ids", "text"] if valid else ["ids", "text", "none"]))
    if kind == "ids":
        req.token_ids.ids.extend(draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=48) if valid
                                      else token_ids))
    elif kind == "text":
        req.text = draw(st.text(min_size=1, max_size=120) if valid else st.text(max_size=400))
    return req


# Raw bytes: anything, a valid message with bytes flipped or cut, or a field carrying a varint too wide for it.
@st.composite
def mutated(draw, message: st.SearchStrategy) -> bytes:
    data = bytearray(draw(message).SerializeToString())
    action = draw(st.sampled_from(["flip", "cut", "append-wide", "raw"]))
    if action == "flip" and data:
        i = draw(st.integers(0, len(data) - 1))
        data[i] ^= draw(st.integers(1, 255))
    elif action == "cut" and data:
        del data[draw(st.integers(0, len(data) - 1)):]
    elif action == "append-wide":
        number = draw(st.integers(1, 9))
        data += varint(number << 3) + varint(draw(st.integers(2**32, 2**64 - 1)))
    else:
        return draw(st.binary(max_size=300))
    return bytes(data)


handle = st.builds(wk.TransferHandle, engine_id=st.text(max_size=12), agent_name=st.text(max_size=12),
                   request_id=st.text(max_size=12), num_tokens=u32, kv_block_ids=st.lists(u32, max_size=16),
                   state_slot=u32, lease_expiry=st.floats(allow_nan=True), side_channel_host=st.text(max_size=16),
                   side_channel_port=u32)


@st.composite
def decode_request(draw) -> wk.DecodeRequest:
    valid = draw(st.booleans())
    req = wk.DecodeRequest(request_id=draw(request_id), sampling=draw(sampling(valid)),
                           prompt_token_ids=draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=48)
                                                 if valid else token_ids))
    if draw(st.booleans()):
        req.handle.CopyFrom(draw(handle))
    return req


prefill_request = st.builds(wk.PrefillRequest, request_id=request_id, prompt_token_ids=token_ids)


# ---- the router ----------------------------------------------------------------------------------------------
@fuzz(300)
@given(req=generate_request())
def test_router_generate_messages(channels, req):
    stub = gen_grpc.GenerationStub(channels["router"])
    _check(*_code(lambda: _first_then_cancel(stub.Generate(req, timeout=CALL_TIMEOUT_S))), ROUTER_CODES)


@fuzz(250)
@given(data=mutated(generate_request()), method=st.sampled_from(["Generate", "Abort", "ModelInfo", "Health"]))
def test_router_raw_bytes(channels, data, method):
    path = f"/baton.v1.Generation/{method}"
    if method == "Generate":
        call = lambda: _first_then_cancel(channels["router"].unary_stream(path)(data, timeout=CALL_TIMEOUT_S))  # noqa: E731
    else:
        call = lambda: channels["router"].unary_unary(path)(data, timeout=CALL_TIMEOUT_S)  # noqa: E731
    _check(*_code(call), ROUTER_CODES)


# ---- the nodes -----------------------------------------------------------------------------------------------
@fuzz(250)
@given(node=st.sampled_from(["prefill", "decode"]), prefill=prefill_request, decode=decode_request(),
       method=st.sampled_from(["Prefill", "Decode", "Abort"]))
def test_worker_messages(channels, node, prefill, decode, method):
    stub, md = wk_grpc.WorkerStub(channels[node]), _metadata()
    if method == "Prefill":
        code = _code(lambda: stub.Prefill(prefill, timeout=CALL_TIMEOUT_S, metadata=md))
        # A prefill that succeeded holds its caches under a lease: hand them back, as the router would.
        stub.Abort(wk.WorkerAbortRequest(request_id=prefill.request_id), timeout=CALL_TIMEOUT_S, metadata=md)
    elif method == "Decode":
        code = _code(lambda: _first_then_cancel(stub.Decode(decode, timeout=CALL_TIMEOUT_S, metadata=md)))
    else:
        code = _code(lambda: stub.Abort(wk.WorkerAbortRequest(request_id=prefill.request_id),
                                        timeout=CALL_TIMEOUT_S, metadata=md))
    _check(*code, WORKER_CODES)


@fuzz(200)
@given(node=st.sampled_from(["prefill", "decode"]),
       method=st.sampled_from(["Prefill", "Decode", "Abort", "Load", "Info"]),
       data=st.one_of(mutated(prefill_request), mutated(decode_request()), st.binary(max_size=64)))
def test_worker_raw_bytes(channels, node, method, data):
    ch, md = channels[node], _metadata()
    path = f"/baton.v1.Worker/{method}"
    if method == "Decode":
        call = lambda: _first_then_cancel(ch.unary_stream(path)(data, timeout=CALL_TIMEOUT_S, metadata=md))  # noqa: E731
    else:
        call = lambda: ch.unary_unary(path)(data, timeout=CALL_TIMEOUT_S, metadata=md)  # noqa: E731
    code = _code(call)
    if method == "Prefill" and code[0] == C.OK:
        # (A decodable prefill holds a lease: released by id, which only a parse of the same bytes knows.)
        rid = wk.PrefillRequest.FromString(data).request_id
        wk_grpc.WorkerStub(ch).Abort(wk.WorkerAbortRequest(request_id=rid), timeout=CALL_TIMEOUT_S, metadata=md)
    _check(*code, WORKER_CODES)


# ---- afterwards ----------------------------------------------------------------------------------------------
def test_nothing_died_and_nothing_leaked(cluster, channels):
    """Runs last in this module: after every case above, every process is alive and holds nothing."""
    assert {n: p.poll() for n, p in cluster.procs.items() if p.poll() is not None} == {}
    md = _metadata()
    deadline = time.monotonic() + 15.0
    while True:
        loads = [wk_grpc.WorkerStub(channels[n]).Load(wk.LoadRequest(), timeout=5, metadata=md)
                 for n in ("prefill", "decode")]
        free = all(x.free_kv_blocks == x.total_kv_blocks and x.free_state_slots == x.total_state_slots
                   and x.held_leases == 0 and x.running == 0 and x.waiting == 0 for x in loads)
        if free or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert free, loads
    with urllib.request.urlopen(f"{cluster.router_http_url}/metrics", timeout=5) as r:
        metrics = r.read().decode()
    assert re.search(r"^baton_router_in_flight_requests 0\.0$", metrics, re.M), metrics
