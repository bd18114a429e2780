"""Prefill and decode nodes as real processes, driven over their Worker gRPC API (no router): the N-1
rule end to end over NIXL, local prefill, and nothing left allocated afterwards."""

import concurrent.futures
import time

import grpc
import pytest

from baton.cli.cluster import Cluster
from baton.engine.llm_engine import LLMEngine
from baton.engine.make_model import make_model
from baton.engine.sampling_params import SamplingParams
from baton.proto.convert import sampling_to_proto
from baton.proto.v1 import worker_pb2 as wk
from baton.proto.v1 import worker_pb2_grpc as wk_grpc
from tests.node_channel import node_channel

ENGINE_ARGS = ("--block-size", "8", "--max-num-batched-tokens", "32", "--max-num-seqs", "8",
               "--num-kv-blocks", "256")
LENGTHS = (2, 3, 7, 8, 9, 31, 33, 120)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = tmp_path_factory.mktemp("nodes") / "tiny"
    make_model(model, preset="tiny", seed=21, progress=False)
    c = Cluster(str(model), prefill_workers=1, decode_workers=1, engine_args=ENGINE_ARGS,
                log_dir=str(tmp_path_factory.mktemp("logs")))
    c.start(router=False)
    yield c
    c.stop()


def offline(model, prompts, params):
    engine = LLMEngine.from_pretrained(model)
    return [list(o.token_ids) for o in engine.generate(prompts, params)]


def decode(stub, rid, prompt, params, handle=None):
    req = wk.DecodeRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling_to_proto(params))
    if handle is not None:
        req.handle.CopyFrom(handle)
    tokens, local = [], None
    for msg in stub.Decode(req, timeout=120):
        local = msg.prefilled_locally if local is None else local
        tokens += list(msg.token_ids)
    return tokens, local


def test_r1_prefill_n_minus_1_then_decode_over_nixl_equals_one_engine(cluster):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = [[(7 * i + 3 * n) % 500 + 3 for i in range(n)] for n in LENGTHS]
    ref = offline(cluster.model, prompts, params)
    with node_channel(cluster.prefill_addrs[0]) as pch, node_channel(cluster.decode_addrs[0]) as dch:
        pstub, dstub = wk_grpc.WorkerStub(pch), wk_grpc.WorkerStub(dch)

        def one(i_p):
            i, p = i_p
            handle = pstub.Prefill(wk.PrefillRequest(request_id=f"r{i}", prompt_token_ids=p), timeout=60).handle
            assert handle.num_tokens == len(p) - 1  # R1
            return decode(dstub, f"r{i}", p, params, handle)

        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:  # all in flight at once
            outs = list(pool.map(one, enumerate(prompts)))
        assert [t for t, _ in outs] == ref
        assert not any(local for _, local in outs)
        # The prefill node frees a lease when the READ's NIXL notification reaches it, which can trail the
        # decode stream's end by a moment; a lost notification would hold it for the 30 s lease.
        deadline = time.monotonic() + 10.0
        while (ploads := pstub.Load(wk.LoadRequest())).held_leases and time.monotonic() < deadline:
            time.sleep(0.05)
        dload = dstub.Load(wk.LoadRequest())
    assert ploads.held_leases == 0 and ploads.free_kv_blocks == ploads.total_kv_blocks
    assert ploads.free_state_slots == ploads.total_state_slots
    assert dload.free_kv_blocks == dload.total_kv_blocks and dload.free_state_slots == dload.total_state_slots


def test_decode_without_handle_prefills_locally(cluster):
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = [[5], [9, 10, 11, 12, 13]]
    ref = offline(cluster.model, prompts, params)
    with node_channel(cluster.decode_addrs[0]) as ch:
        stub = wk_grpc.WorkerStub(ch)
        outs = [decode(stub, f"local{i}", p, params) for i, p in enumerate(prompts)]
    assert [t for t, _ in outs] == ref and all(local for _, local in outs)


def test_handle_with_all_n_tokens_is_refused(cluster):
    # R1: a handle that covers all N tokens of the prompt it comes with would make the decode node advance the
    # recurrent state over token N twice; the decode node refuses it. (The handle itself is genuine: one
    # altered to claim N tokens is refused earlier, by its signature, tests/test_cluster_auth.py.)
    p = [4, 5, 6, 7]
    with node_channel(cluster.prefill_addrs[0]) as pch, node_channel(cluster.decode_addrs[0]) as dch:
        handle = wk_grpc.WorkerStub(pch).Prefill(wk.PrefillRequest(request_id="bad", prompt_token_ids=p)).handle
        with pytest.raises(grpc.RpcError) as e:
            decode(wk_grpc.WorkerStub(dch), "bad", p[:-1], SamplingParams(max_tokens=2), handle)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "num_tokens" in e.value.details()
        assert wk_grpc.WorkerStub(pch).Abort(wk.WorkerAbortRequest(request_id="bad")).found  # lease released
        assert wk_grpc.WorkerStub(pch).Load(wk.LoadRequest()).held_leases == 0


def test_reused_request_ids_are_refused_or_served_and_no_node_dies(cluster):
    """Request ids reused at once (a client that picks its own): a second Prefill under an id whose lease is still
    held is refused at once, not left waiting; a Decode under the id of one just cancelled is served; both nodes
    serve after it all, with nothing leaked (the decode node's engine thread once died of a reused id)."""
    p = [21, 22, 23, 24, 25, 26]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    ref = offline(cluster.model, [p], params)[0]
    with node_channel(cluster.prefill_addrs[0]) as pch, node_channel(cluster.decode_addrs[0]) as dch:
        pstub, dstub = wk_grpc.WorkerStub(pch), wk_grpc.WorkerStub(dch)
        pstub.Prefill(wk.PrefillRequest(request_id="again", prompt_token_ids=p), timeout=60)
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            pstub.Prefill(wk.PrefillRequest(request_id="again", prompt_token_ids=p), timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "lease" in e.value.details()
        assert time.monotonic() - t0 < 10
        assert pstub.Abort(wk.WorkerAbortRequest(request_id="again")).found
        served = 0
        for i in range(20):
            call = dstub.Decode(wk.DecodeRequest(request_id="same", prompt_token_ids=p,
                                                 sampling=sampling_to_proto(params)), timeout=60)
            try:
                for j, _ in enumerate(call):
                    if j >= i % 4:
                        call.cancel()
                        break
                served += 1
            except grpc.RpcError as e:  # the cancelled one not ended there yet: a clear refusal, at once
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "duplicate" in e.details(), e.details()
        assert served

        def idle() -> wk.LoadResponse:
            deadline = time.monotonic() + 10
            while ((load := dstub.Load(wk.LoadRequest())).running or load.waiting) and time.monotonic() < deadline:
                time.sleep(0.05)
            return load

        idle()
        assert decode(dstub, "same", p, params) == (ref, True)
        load = idle()
        assert load.free_kv_blocks == load.total_kv_blocks and load.free_state_slots == load.total_state_slots
        assert pstub.Load(wk.LoadRequest()).held_leases == 0
