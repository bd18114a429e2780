"""The `baton` command line as a user runs it: its commands through `main(argv)` in this process (exit code, stdout
and stderr as the user sees them), and `baton up` as a real process that Ctrl-C stops."""

import io
import json
import signal
import socket
import subprocess
import sys
import time
from contextlib import redirect_stderr, redirect_stdout

import pytest

from baton.cli.cluster import free_port_block
from baton.cli.main import build_parser, main
from baton.engine.engine_config import EngineConfig
from baton.engine.llm_engine import LLMEngine
from baton.engine.sampling_params import SamplingParams
from baton.node.engine_args import engine_config_from_args, engine_flags


def baton(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`baton ARGS` in this process (no interpreter start per call); argparse's refusals exit like the script's."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:
            code = e.code
    proc = subprocess.CompletedProcess(["baton", *args], code, out.getvalue(), err.getvalue())
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def baton_process(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`baton ARGS` as a process of its own, for a command whose point is talking to another process."""
    proc = subprocess.run([sys.executable, "-m", "baton.cli.main", *args], capture_output=True, text=True,
                          timeout=300)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "tiny"
    proc = baton("make-model", str(out), "--preset", "tiny", "--seed", "5", "--set", "vocab_size=64")
    assert str(out) in proc.stdout
    return out


@pytest.fixture(scope="module")
def mtp_model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "tiny-mtp"
    # A vocabulary of 8 makes the random drafter right often enough that drafts get accepted.
    baton("make-model", str(out), "--preset", "tiny", "--seed", "3", "--mtp-layers", "1", "--set", "vocab_size=8")
    return out


def test_generate_json_lines_in_input_order_match_the_engine(model_dir):
    prompts = ["1 2 3", "9", " ".join(str(i % 60 + 3) for i in range(40)), "4 5"]
    args = ["generate", "--model", str(model_dir), "--max-tokens", "6", "--json", "--ignore-eos",
            "--max-num-batched-tokens", "16", "--max-num-seqs", "8", "--speculative-tokens", "0"]
    for p in prompts:
        args += ["--prompt-ids", p]
    proc = baton(*args)
    lines = [json.loads(x) for x in proc.stdout.splitlines()]
    assert [x["prompt_ids"] for x in lines] == [[int(t) for t in p.split()] for p in prompts]
    assert all(list(x) == ["prompt_ids", "token_ids", "finish_reason", "spec"] for x in lines)
    # Speculative decoding off: the spec field is there, with zeros; the summary says nothing of MTP.
    assert all(x["spec"] == {"drafted": 0, "accepted": 0} for x in lines)
    assert "MTP" not in proc.stderr
    engine = LLMEngine.from_pretrained(model_dir)
    ref = engine.generate([x["prompt_ids"] for x in lines], SamplingParams(max_tokens=6, ignore_eos=True))
    assert [x["token_ids"] for x in lines] == [list(o.token_ids) for o in ref]
    assert all(x["finish_reason"] == "length" for x in lines)


def test_generate_speculative_tokens_report_drafts_and_keep_greedy_output(mtp_model_dir):
    prompts = ["1 2 3", "4", " ".join(str(i % 8) for i in range(21)), "5 6"]
    args = ["generate", "--model", str(mtp_model_dir), "--max-tokens", "12", "--json", "--ignore-eos",
            "--speculative-tokens", "2"]
    for p in prompts:
        args += ["--prompt-ids", p]
    proc = baton(*args)
    lines = [json.loads(x) for x in proc.stdout.splitlines()]
    assert [x["prompt_ids"] for x in lines] == [[int(t) for t in p.split()] for p in prompts]
    for x in lines:
        drafted, accepted = x["spec"]["drafted"], x["spec"]["accepted"]
        assert 0 < drafted <= 2 * len(x["token_ids"]) and 0 <= accepted <= drafted, x
    assert sum(x["spec"]["accepted"] for x in lines) > 0
    assert "drafted" in proc.stderr and "mean acceptance length" in proc.stderr
    # Greedy verification keeps the output of the engine without speculative decoding, token for token.
    ref = LLMEngine.from_pretrained(mtp_model_dir, EngineConfig(num_speculative_tokens=0)).generate(
        [x["prompt_ids"] for x in lines], SamplingParams(max_tokens=12, ignore_eos=True))
    assert [x["token_ids"] for x in lines] == [list(o.token_ids) for o in ref]


@pytest.mark.parametrize("k,needle", [("3", "without MTP weights"), ("9", "0..8, got 9")])
def test_generate_bad_speculative_tokens_is_a_one_line_error(model_dir, k, needle):
    # model_dir has no MTP weights: K > 0 is refused when the engine is built, K = 9 by the config.
    proc = baton("generate", "--model", str(model_dir), "--prompt-ids", "1 2", "--speculative-tokens", k, check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("baton generate: error: engine field 'num_speculative_tokens'")
    assert needle in proc.stderr and len(proc.stderr.splitlines()) == 1


def test_speculative_tokens_reach_the_node_processes():
    # `baton up` / `baton demo` pass engine flags on to the nodes, whose parser must read them back.
    from baton.node.serve import node_parser

    a = build_parser().parse_args(["up", "--model", "m", "--speculative-tokens", "2", "--block-size", "8"])
    flags = engine_flags(a)
    assert flags == ["--block-size", "8", "--speculative-tokens", "2"]
    for role in ("prefill", "decode"):
        node = node_parser(role).parse_args(["--model", "m", "--port", "1", *flags])
        assert engine_config_from_args(node) == EngineConfig(block_size=8, num_speculative_tokens=2)
    assert engine_config_from_args(build_parser().parse_args(["up", "--model", "m"])).num_speculative_tokens == 0


def test_up_refuses_bad_speculative_tokens_before_starting_anything():
    proc = baton("up", "--model", "m", "--speculative-tokens", "9", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == ("baton up: error: engine field 'num_speculative_tokens': expected an integer in "
                                   "0..8, got 9")


def test_generate_stops_at_eos(model_dir):
    # The preset's EOS id is 2: with vocab 64 and a stop id list naming every token, the first token stops.
    everything = " ".join(str(i) for i in range(64))
    out = baton("generate", "--model", str(model_dir), "--prompt-ids", "3 4", "--json", "--max-tokens", "5",
                "--stop-token-ids", everything).stdout
    line = json.loads(out)
    assert len(line["token_ids"]) == 1 and line["finish_reason"] == "stop"


def test_generate_seeded_sampling_is_reproducible(model_dir):
    args = ["generate", "--model", str(model_dir), "--prompt-ids", "3 4 5", "--json", "--max-tokens", "8",
            "--temperature", "1.0", "--top-p", "0.9", "--top-k", "20", "--seed", "11", "--ignore-eos"]
    assert baton(*args).stdout == baton(*args).stdout


@pytest.mark.parametrize("args,needle", [
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "1.5"], "top_p"),
    (["--max-tokens", "0"], "max_tokens"),
    (["--prompt-ids", "1 99999"], "prompt_token_ids"),
])
def test_generate_bad_input_is_a_clear_error(model_dir, args, needle):
    proc = baton("generate", "--model", str(model_dir), "--prompt-ids", "1 2", *args, check=False)
    assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr


def test_generate_bad_model_dir_is_a_clear_error(tmp_path):
    proc = baton("generate", "--model", str(tmp_path / "nope"), "--prompt-ids", "1", check=False)
    assert proc.returncode == 2 and "config.json" in proc.stderr and "Traceback" not in proc.stderr


def test_demo_streams_through_the_disaggregated_path(model_dir):
    out = baton("demo", "--model", str(model_dir), "--max-tokens", "4", "--num-kv-blocks", "256").stdout
    assert "router -> prefill -> NIXL -> decode" in out and "output tok/s" in out and "TTFT" in out
    assert out.count("<length>") == 5  # every sample request finished


def test_up_serves_until_interrupted_then_stops_every_process(model_dir, tmp_path):
    port = free_port_block(4)  # router gRPC + HTTP, one prefill and one decode node
    keys = tmp_path / "keys"
    keys.write_text("k1\n")
    proc = subprocess.Popen([sys.executable, "-m", "baton.cli.main", "up", "--model", str(model_dir), "--port",
                             str(port), "--num-kv-blocks", "128", "--api-keys-file", str(keys)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        while line and "Ctrl-C stops" not in line:
            line = proc.stdout.readline()
        assert f"router on 127.0.0.1:{port} (metrics http://127.0.0.1:{port + 1}/metrics)" in line
        out = json.loads(baton_process("client", "generate", "--addr", f"127.0.0.1:{port}", "--prompt-ids",
                                       "3 4 5 6", "--max-tokens", "3", "--ignore-eos", "--json", "--api-key",
                                       "k1").stdout)
        assert len(out["token_ids"]) == 3 and out["finish_reason"] == "length"
        # The router got the key file: without a key the call is refused.
        refused = baton_process("client", "generate", "--addr", f"127.0.0.1:{port}", "--prompt-ids", "3 4 5 6",
                                "--max-tokens", "3", check=False)
        assert refused.returncode != 0 and "UNAUTHENTICATED" in refused.stderr
    finally:
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0 and "baton up: stopped" in rest
    time.sleep(0.5)
    # Nothing of the cluster is left listening (a connect is refused; TIME_WAIT pairs may linger).
    # Router gRPC and HTTP, the nodes' gRPC, the nodes' HTTP endpoints (port + 2000) and baton up's /metrics.
    for p in (port, port + 1, port + 2, port + 3, port + 2002, port + 2003, port + 2000):
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", p), timeout=2).close()


def test_up_role_engine_args_reach_their_role_only_and_win_over_the_common_flags():
    """`baton up --prefill-engine-args / --decode-engine-args`: each role's node command line ends with its own
    flags, which its parser reads back over the common ones (a later flag wins)."""
    from baton.cli.up_cmd import cluster_from_args
    from baton.node.serve import node_parser

    a = build_parser().parse_args(["up", "--model", "m", "--max-num-batched-tokens", "2048",
                                   "--prefill-engine-args", "--max-num-batched-tokens 8192 --max-num-seqs 64",
                                   "--decode-engine-args", "--long-prefill-token-threshold 256"])
    cluster = cluster_from_args(a)
    assert cluster.prefill_args == ("--max-num-batched-tokens", "8192", "--max-num-seqs", "64")
    assert cluster.decode_args == ("--long-prefill-token-threshold", "256")
    for name, want in (("prefill-0", EngineConfig(max_num_batched_tokens=8192, max_num_seqs=64)),
                       ("decode-0", EngineConfig(max_num_batched_tokens=2048, long_prefill_token_threshold=256))):
        role = name.split("-")[0]
        node = node_parser(role).parse_args(cluster.node_argv(name))
        assert engine_config_from_args(node) == want
    plain = cluster_from_args(build_parser().parse_args(["up", "--model", "m"]))
    assert plain.prefill_args == plain.decode_args == ()


def test_up_passes_the_tensor_parallel_size_to_every_role_s_nodes():
    """`--tensor-parallel-size` is an engine flag every node gets (common or per role), prefill and decode nodes of
    different sizes included: each decode rank reads its shard from the prefill ranks that hold it (#50)."""
    from baton.cli.up_cmd import cluster_from_args
    from baton.node.serve import node_parser

    a = build_parser().parse_args(["up", "--model", "m", "--prefill-workers", "0", "--tensor-parallel-size", "2"])
    node = node_parser("decode").parse_args(cluster_from_args(a, gpus=0).node_argv("decode-0"))
    assert engine_config_from_args(node).tensor_parallel_size == 2
    a = build_parser().parse_args(["up", "--model", "m", "--prefill-workers", "1", "--prefill-engine-args",
                                   "--tensor-parallel-size 4", "--decode-engine-args", "--tensor-parallel-size 2"])
    cluster = cluster_from_args(a, gpus=0)
    for role, tp in (("prefill", 4), ("decode", 2)):
        node = node_parser(role).parse_args(cluster.node_argv(f"{role}-0"))
        assert engine_config_from_args(node).tensor_parallel_size == tp, role
    # A Ray actor asks for a GPU share per rank of its role's nodes.
    from baton.cli.ray_cmd import RayCluster

    ray = RayCluster("m", prefill_workers=0, engine_args=("--tensor-parallel-size", "2"),
                     decode_engine_args=("--tensor-parallel-size=4",))
    assert (ray.role_ranks("prefill"), ray.role_ranks("decode")) == (2, 4)


def test_up_router_args_reach_the_router_and_bad_ones_are_refused_before_starting():
    from baton.cli.up_cmd import cluster_from_args

    a = build_parser().parse_args(["up", "--model", "m", "--router-args", "--max-inflight-per-client 8"])
    assert cluster_from_args(a, gpus=0).router_args[-2:] == ("--max-inflight-per-client", "8")
    for bad in ("--no-such-flag 1", "--max-inflight-per-client many", "'unclosed"):
        a = build_parser().parse_args(["up", "--model", "m", "--router-args", bad])
        with pytest.raises(ValueError, match="--router-args"):
            cluster_from_args(a, gpus=0)


def test_a_prefill_node_takes_its_own_step_budget_where_no_flag_gives_one():
    """Prefill nodes' steps carry no decode rows: left out, their budget is PREFILL_MAX_NUM_BATCHED_TOKENS (8192),
    not the engine's 512, which is sized for steps that carry decode rows. A budget
    given on the command line, common or the role's, still wins; decode nodes keep the engine's default."""
    from baton.cli.up_cmd import cluster_from_args
    from baton.decode_node.server import parser as decode_parser
    from baton.engine.engine_config import PREFILL_MAX_NUM_BATCHED_TOKENS
    from baton.prefill_node.server import parser as prefill_parser

    assert PREFILL_MAX_NUM_BATCHED_TOKENS == 8192 > EngineConfig().max_num_batched_tokens == 512
    base = ["--model", "m", "--port", "5000"]
    assert engine_config_from_args(prefill_parser().parse_args(base)).max_num_batched_tokens == 8192
    assert "token budget of one step (8192)" in " ".join(prefill_parser().format_help().split())
    assert engine_config_from_args(prefill_parser().parse_args(
        [*base, "--max-num-batched-tokens", "2048"])).max_num_batched_tokens == 2048
    assert engine_config_from_args(decode_parser().parse_args(base)).max_num_batched_tokens == 512
    # Through `baton up`: the common budget reaches both roles; without one each role takes its own default.
    for common, want in (([], {"prefill-0": 8192, "decode-0": 512}),
                         (["--max-num-batched-tokens", "1024"], {"prefill-0": 1024, "decode-0": 1024})):
        cluster = cluster_from_args(build_parser().parse_args(["up", "--model", "m", *common]))
        got = {name: engine_config_from_args(parse().parse_args(cluster.node_argv(name))).max_num_batched_tokens
               for name, parse in (("prefill-0", prefill_parser), ("decode-0", decode_parser))}
        assert got == want
    # The role's flags are checked against the role's budget: 600 state slots fit a prefill node's 8192-token
    # step, not a decode node's 512.
    cluster = cluster_from_args(build_parser().parse_args(["up", "--model", "m", "--prefill-engine-args",
                                                           "--max-num-seqs 600"]))
    assert cluster.prefill_args == ("--max-num-seqs", "600")
    with pytest.raises(ValueError, match="engine field 'max_num_batched_tokens'"):
        cluster_from_args(build_parser().parse_args(["up", "--model", "m", "--decode-engine-args",
                                                     "--max-num-seqs 600"]))


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--prefill-engine-args", "--bogus 1", "--prefill-engine-args: expected engine flags only, got unknown '--bogus 1'"),
    ("--decode-engine-args", "--max-num-seqs x", "--decode-engine-args: expected engine flags, got '--max-num-seqs x'"),
    ("--decode-engine-args", "--device 'cuda", "--decode-engine-args: expected shell words, got \"--device 'cuda\""),
    # Checked together with the common flags: a budget below the role's --max-num-seqs is refused.
    ("--prefill-engine-args", "--max-num-seqs 64 --max-num-batched-tokens 32",
     "engine field 'max_num_batched_tokens'"),
])
def test_up_refuses_bad_role_engine_args_before_starting_anything(flag, value, message):
    proc = baton("up", "--model", "m", flag, value, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("baton up: error: ") and message in proc.stderr, proc.stderr
