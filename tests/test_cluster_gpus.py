"""Per-node GPU pinning of the local cluster (`Cluster.node_gpus`, `baton up --node-gpus`): node i in launch order
(prefill nodes, then decode nodes) gets CUDA_VISIBLE_DEVICES = its GPU first (one per tensor-parallel rank, the next
ones in the list), then the other listed GPUs; the router and every process without `node_gpus` inherit the
environment unchanged."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from baton.cli.cluster import Cluster
from baton.cli.main import build_parser
from baton.cli.up_cmd import gpu_list
from baton.engine.make_model import make_model

# A port far from anything real: no process is started by the tests that only compute environments.
PORT = 40000


def visible(c: Cluster) -> dict[str, str]:
    return {n: c.node_env(n)["CUDA_VISIBLE_DEVICES"] for n in c.node_names}


@pytest.mark.parametrize(("prefill", "decode", "gpus", "expected"), [
    # serving_bench's disagg (1P1D) and agg (2 replicas) on 2 GPUs.
    (1, 1, (0, 1), {"prefill-0": "0,1", "decode-0": "1,0"}),
    (0, 2, (0, 1), {"decode-0": "0,1", "decode-1": "1,0"}),
    # More nodes than GPUs: cyclic; the listed order and ids are kept, unlisted GPUs stay hidden.
    (2, 3, (2, 5), {"prefill-0": "2,5", "prefill-1": "5,2", "decode-0": "2,5", "decode-1": "5,2",
                    "decode-2": "2,5"}),
    (1, 2, (3,), {"prefill-0": "3", "decode-0": "3", "decode-1": "3"}),
    (1, 1, (1, 0, 2), {"prefill-0": "1,0,2", "decode-0": "0,1,2"}),
])
def test_each_node_gets_its_gpu_first_then_the_others(prefill, decode, gpus, expected):
    c = Cluster("m", prefill_workers=prefill, decode_workers=decode, port=PORT, node_gpus=gpus)
    assert c.node_names == [*(f"prefill-{i}" for i in range(prefill)), *(f"decode-{i}" for i in range(decode))]
    assert visible(c) == expected
    assert {n: c.node_gpu(n) for n in c.node_names} == {n: int(v.split(",")[0]) for n, v in expected.items()}


@pytest.mark.parametrize(("prefill", "decode", "gpus", "flags", "expected"), [
    # Two aggregated nodes of two ranks on 4 GPUs: two GPUs each, none shared.
    (0, 2, (0, 1, 2, 3), ("--tensor-parallel-size", "2"), {"decode-0": "0,1,2,3", "decode-1": "2,3,0,1"}),
    # A later flag wins, in either spelling; fewer GPUs than ranks: the node refuses to start (`check_devices`).
    (0, 1, (4, 5, 6), ("--tensor-parallel-size", "2", "--tensor-parallel-size=3"), {"decode-0": "4,5,6"}),
    (0, 2, (0, 1, 2), ("--tensor-parallel-size", "2"), {"decode-0": "0,1,2", "decode-1": "2,0,1"}),
])
def test_a_node_of_several_ranks_gets_one_gpu_per_rank_first(prefill, decode, gpus, flags, expected):
    c = Cluster("m", prefill_workers=prefill, decode_workers=decode, port=PORT, node_gpus=gpus, engine_args=flags)
    assert visible(c) == expected


def test_node_env_is_this_environment_plus_the_gpu_list(monkeypatch):
    monkeypatch.setenv("BATON_TEST_MARKER", "kept")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    env = Cluster("m", prefill_workers=0, decode_workers=2, port=PORT, node_gpus=(0, 1)).node_env("decode-1")
    assert env == {**os.environ, "CUDA_VISIBLE_DEVICES": "1,0"}
    # Without node_gpus nothing is changed (Popen's env=None: inherit).
    c = Cluster("m", decode_workers=2, port=PORT)
    assert c.node_gpus == () and c.node_env("decode-0") is None and c.node_gpu("decode-0") is None


@pytest.mark.parametrize("bad", [(-1,), (0, 0), (1, True), (0.0,), ("0",)])
def test_cluster_refuses_bad_gpu_ids(bad):
    with pytest.raises(ValueError, match=r"node_gpus: expected distinct non-negative integer GPU ids, got "):
        Cluster("m", port=PORT, node_gpus=bad)


def test_node_gpus_flag():
    parse = build_parser().parse_args
    assert parse(["up", "--model", "m"]).node_gpus == ()
    assert parse(["up", "--model", "m"]).cuda_ipc is None and parse(["up", "--model", "m", "--cuda-ipc"]).cuda_ipc
    assert parse(["up", "--model", "m", "--node-gpus", "0,1"]).node_gpus == (0, 1)
    assert parse(["up", "--model", "m", "--node-gpus", "3"]).node_gpus == (3,)
    assert gpu_list(" 2, 0 ") == (2, 0)


@pytest.mark.parametrize("text", ["", "0,", "a", "0,-1", "1.5", "0,0", "0;1", "²"])
def test_node_gpus_flag_refuses_bad_lists(capsys, text):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["up", "--model", "m", "--node-gpus", text])
    assert e.value.code == 2
    assert (f"argument --node-gpus: expected distinct comma-separated non-negative integers (e.g. 0,1), "
            f"got {text!r}") in capsys.readouterr().err


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(kv.split("=", 1) for kv in raw.decode().split("\0") if "=" in kv)


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")
def test_real_cluster_processes_run_with_their_gpu_lists(tmp_path, monkeypatch):
    """Real router + 1 prefill + 2 decode node processes on the CPU (tiny model): each node process's
    environment (read from /proc) has its own CUDA_VISIBLE_DEVICES; the router's is this process's."""
    model = make_model(tmp_path / "tiny", preset="tiny", seed=5, overrides={"vocab_size": 64}, progress=False,
                       tokenizer=False)
    monkeypatch.setenv("BATON_TEST_MARKER", "kept")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")  # the router keeps it; the nodes run on the CPU anyway
    with Cluster(str(model), prefill_workers=1, decode_workers=2, node_gpus=(0, 1),
                 engine_args=("--device", "cpu", "--num-kv-blocks", "64"), log_dir=str(tmp_path / "logs")) as c:
        envs = {name: environ(p.pid) for name, p in c.procs.items()}
    assert set(envs) == {"router", "prefill-0", "decode-0", "decode-1"}
    assert {n: e["CUDA_VISIBLE_DEVICES"] for n, e in envs.items()} == {
        "prefill-0": "0,1", "decode-0": "1,0", "decode-1": "0,1", "router": "7"}
    assert all(e["BATON_TEST_MARKER"] == "kept" for e in envs.values())


def test_role_flags_go_to_their_role_only_and_come_last():
    """`prefill_args` reach the prefill nodes, `decode_args` the decode nodes, after the common engine flags (a
    later flag wins: a role's budget overrides the cluster's)."""
    c = Cluster("m", prefill_workers=1, decode_workers=2, port=PORT,
                engine_args=("--max-num-batched-tokens", "2048"), node_args=("--cuda-ipc",),
                prefill_args=("--max-num-batched-tokens", "8192"), decode_args=("--max-num-batched-tokens", "512"))
    argv = {n: c.node_argv(n) for n in c.node_names}
    for name, budget in (("prefill-0", "8192"), ("decode-0", "512"), ("decode-1", "512")):
        a = argv[name]
        assert a[:4] == ["--model", "m", "--host", "127.0.0.1"] and "--cuda-ipc" in a
        assert a[a.index("--engine-id") + 1] == name
        assert a[-2:] == ["--max-num-batched-tokens", budget]
        assert a.index("--max-num-batched-tokens") < len(a) - 2  # the common one is still there, earlier
    ports = {int(a[a.index("--port") + 1]) for a in argv.values()}
    assert len(ports) == 3 and all(int(a[a.index("--http-port") + 1]) != int(a[a.index("--port") + 1])
                                   for a in argv.values())
    assert Cluster("m", decode_workers=1, port=PORT).node_argv("decode-0")[-2:] == ["--engine-id", "decode-0"]


def test_up_defaults_follow_the_gpus_visible():
    """`baton up` with no flags: on one GPU aggregated (no prefill node), on none or several 1P1D; GPU nodes move
    caches through CUDA IPC; nodes sharing a GPU split its memory; given flags win."""
    from baton.cli.up_cmd import cluster_from_args, gpu_share, shared_gpu_flags

    def up(*flags: str, gpus: int):
        return cluster_from_args(build_parser().parse_args(["up", "--model", "m", *flags]), gpus=gpus)

    one = up(gpus=1)
    assert (one.prefill_workers, one.node_args, one.engine_args) == (0, ("--cuda-ipc",), ())
    cpu = up(gpus=0)
    assert (cpu.prefill_workers, cpu.node_args, cpu.engine_args) == (1, (), ())
    two = up("--node-gpus", "0,1", gpus=2)
    assert (two.prefill_workers, two.node_args, two.engine_args) == (1, ("--cuda-ipc",), ())
    shared = up("--prefill-workers", "1", gpus=1)  # 1P1D on one GPU: each node 0.45 of it
    assert shared.engine_args == ("--gpu-memory-utilization", "0.45")
    assert up("--prefill-workers", "2", "--decode-workers", "2", "--node-gpus", "0,1", gpus=2).engine_args == (
        "--gpu-memory-utilization", "0.45")
    assert up("--prefill-workers", "1", "--gpu-memory-utilization", "0.3", gpus=1).engine_args == (
        "--gpu-memory-utilization", "0.3")
    assert up("--prefill-workers", "1", "--cache-memory-mb", "4096", gpus=1).engine_args == (
        "--cache-memory-mb", "4096")
    assert up("--prefill-workers", "1", "--no-cuda-ipc", gpus=1).node_args == ()
    assert up("--cuda-ipc", gpus=0).node_args == ("--cuda-ipc",)
    assert [gpu_share(n, g) for n, g in ((1, ()), (2, ()), (3, ()), (4, (0, 1)), (3, (0, 1)))] == [
        0.9, 0.45, 0.3, 0.45, 0.45]
    # `baton demo` shares GPU 0 the same way; pools given in blocks need no share.
    demo = build_parser().parse_args(["demo", "--model", "m"])
    assert shared_gpu_flags(demo, 2, (), 1) == ("--gpu-memory-utilization", "0.45")
    assert shared_gpu_flags(demo, 2, (), 0) == ()
    blocks = build_parser().parse_args(["demo", "--model", "m", "--num-kv-blocks", "64"])
    assert shared_gpu_flags(blocks, 2, (), 1) == ()
