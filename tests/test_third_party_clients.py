"""Third-party clients, unmodified, against a real cluster (router + prefill node + decode node processes):
lm-evaluation-harness's `local-completions` model on a loglikelihood (multiple choice) task and a generation task,
both made here (the package ships no data), and NVIDIA's aiperf streaming chat with `--per-chunk-usage` (the
router's `stream_options.continuous_usage_stats`). The clients run from their own venv, `.venv-clients`, which
`make test` creates (deploy/requirements/clients.txt); outside CI a checkout without it skips these tests.

The loglikelihoods lm-eval reports must equal the offline engine's prompt logprobs of the same continuation tokens,
so a router that shifted, dropped or mislabelled an echoed logprob fails here."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from baton.cli.cluster import Cluster
from baton.engine.make_model import make_model
from baton.engine.sampling_params import SamplingParams
from baton.engine.tokenizer import load_tokenizer
from tests.test_e2e import ENGINE_ARGS
from tests.test_openai_http import with_chat_template
from tests.test_openai_logprobs import TOL, offline

ROOT = Path(__file__).resolve().parent.parent
CLIENTS_BIN = ROOT / ".venv-clients" / "bin"

QUESTIONS = [
    {"question": "Q: Is the sky blue?\nA:", "choices": ["yes", "no"], "answer": 0},
    {"question": "Q: Which is a number?\nA:", "choices": ["seven", "blue", "cat"], "answer": 0},
    {"question": "Q: Name a colour.\nA:", "choices": ["red", "def"], "answer": 0},
]
PROMPTS = [{"question": "The capital of France is", "answer": "Paris"},
           {"question": "def add(a, b):\n    return", "answer": "a + b"}]


def _clients_bin() -> Path:
    if not (CLIENTS_BIN / "lm_eval").exists() or not (CLIENTS_BIN / "aiperf").exists():
        if os.environ.get("CI"):
            pytest.fail(f"{CLIENTS_BIN.parent} lacks lm_eval or aiperf: `make test` installs them")
        pytest.skip(f"no {CLIENTS_BIN.parent} (`make clients-venv` creates it)")
    return CLIENTS_BIN


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("clients") / "tiny"
    make_model(out, preset="tiny", seed=31, progress=False)
    with_chat_template(out)
    return out


@pytest.fixture(scope="module")
def cluster(model, tmp_path_factory):
    _clients_bin()
    with Cluster(str(model), prefill_workers=1, decode_workers=1, engine_args=ENGINE_ARGS,
                 log_dir=str(tmp_path_factory.mktemp("clients-logs"))) as c:
        yield c


def _run(args: list[str], cwd: Path) -> None:
    # The clients talk to the cluster on loopback only, through no proxy (HF_HUB_OFFLINE would make aiperf take
    # the tokenizer's local path for a hub name).
    env = {**os.environ, "NO_PROXY": "*", "no_proxy": "*", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "HF_HOME": str(cwd / "hf"), "MPLCONFIGDIR": str(cwd / "mpl")}
    for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "PYTHONPATH"):
        env.pop(k, None)
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{args[0]} exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}"


def _task(folder: Path, name: str, rows: list[dict], spec: str) -> None:
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        + spec)


def _encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of (context, continuation) into tokens: trailing spaces move to the continuation."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole, ctx = tok.encode(context + continuation), tok.encode(context)
    return ctx, whole[len(ctx):]


def test_lm_eval_local_completions_scores_and_generates(cluster, model, tmp_path):
    bin_ = _clients_bin()
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    _task(tasks, "baton_choice", QUESTIONS, "output_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
          "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n")
    _task(tasks, "baton_gen", PROMPTS, "output_type: generate_until\ndoc_to_text: '{{question}}'\n"
          "doc_to_target: '{{answer}}'\ngeneration_kwargs:\n  until: ['\\n\\n']\n  max_gen_toks: 8\n"
          "  do_sample: false\nmetric_list:\n  - metric: exact_match\n")
    out = tmp_path / "out"
    args = (f"model=tiny,base_url={cluster.router_http_url}/v1/completions,tokenizer_backend=huggingface,"
            f"tokenizer={model},tokenized_requests=True,max_retries=1,num_concurrent=2")
    _run([str(bin_ / "lm_eval"), "--model", "local-completions", "--model_args", args, "--tasks",
          "baton_choice,baton_gen", "--include_path", str(tasks), "--output_path", str(out), "--log_samples"],
         tmp_path)
    (results,) = out.rglob("results_*.json")
    res = json.loads(results.read_text())["results"]
    assert 0.0 <= res["baton_choice"]["acc,none"] <= 1.0
    assert 0.0 <= res["baton_gen"]["exact_match,none"] <= 1.0

    tok = load_tokenizer(model)
    (samples,) = out.rglob("samples_baton_choice_*.jsonl")
    docs = [json.loads(line) for line in samples.read_text().splitlines()]
    assert sorted(d["doc_id"] for d in docs) == list(range(len(QUESTIONS)))
    accs = []
    for d in docs:
        q = QUESTIONS[d["doc_id"]]
        lls = []
        for k, resp in enumerate(d["resps"]):
            ll = float(resp[0][0])
            assert math.isfinite(ll) and ll < 0, (q, ll)
            args = d["arguments"][f"gen_args_{k}"]
            assert (args["arg_0"], args["arg_1"]) == (q["question"], " " + q["choices"][k])
            ctx, cont = _encode_pair(tok, args["arg_0"], args["arg_1"])
            _, _, plps = offline(model, ctx + cont, SamplingParams(max_tokens=1, prompt_logprobs=1))
            want = sum(plps[j].logprob for j in range(len(ctx), len(ctx) + len(cont)))
            assert ll == pytest.approx(want, abs=TOL * len(cont)), (q["question"], args["arg_1"])
            lls.append(ll)
        accs.append(float(max(range(len(lls)), key=lls.__getitem__) == q["answer"]))
        assert d["acc"] == accs[-1]
    assert res["baton_choice"]["acc,none"] == pytest.approx(sum(accs) / len(accs))
    (samples,) = out.rglob("samples_baton_gen_*.jsonl")
    gens = [json.loads(line)["resps"][0][0] for line in samples.read_text().splitlines()]
    assert len(gens) == len(PROMPTS) and all(isinstance(g, str) and g for g in gens)


def test_aiperf_streams_chat_with_per_chunk_usage(cluster, model, tmp_path):
    bin_ = _clients_bin()
    requests, osl = 6, 10
    _run([str(bin_ / "aiperf"), "profile", "--model", "tiny", "--url", cluster.router_http_url,
          "--endpoint-type", "chat", "--streaming", "--request-count", str(requests), "--concurrency", "2",
          "--synthetic-input-tokens-mean", "40", "--synthetic-input-tokens-stddev", "0",
          "--output-tokens-mean", str(osl), "--output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true",
          "--tokenizer", str(model), "--use-server-token-count", "--per-chunk-usage", "--ui-type", "none",
          "--artifact-dir", str(tmp_path / "aiperf"), "--random-seed", "3"], tmp_path)
    summary = json.loads((tmp_path / "aiperf" / "profile_export_aiperf.json").read_text())
    assert summary["request_count"]["avg"] == requests and not summary["error_summary"]
    assert summary["output_token_count"]["min"] == summary["output_token_count"]["max"] == osl
    assert summary["usage_completion_tokens"]["avg"] == osl
    assert summary["inter_token_latency"]["avg"] > 0
