"""Multi-turn chat benchmark (issue #51 item 4): prefix caching on against off, aggregated and 1P1D.

Workload: `--conversations` conversations of `--turns` turns each. Every conversation opens with the same system prompt
of `--system-tokens` tokens; turn i sends the system prompt, then each earlier turn's user message and the answer the
server gave it, then turn i's user message (`--user-tokens` tokens). A user message is uniform random token ids
(seeded by conversation and turn); an answer is `--answer-min`..`--answer-max` tokens (seeded likewise), greedy with
`ignore_eos`, and the next turn carries exactly the tokens the server streamed. `--concurrency` conversations run at
once, each turn sent when the previous one's answer is complete (closed loop), so a conversation's prompts grow by
one turn each time as a chat client's do.

Configurations (each a real local cluster: router + node processes, `baton.cli.cluster.Cluster`): `agg` (one
aggregated node, prompts prefilled where they decode) and `disagg` (1P1D: every prompt prefilled on the prefill node,
its caches pulled over NIXL, or through CUDA IPC with `--node-args --cuda-ipc`, the GPU default as `baton up`'s where
the nodes share a GPU), each with the engines' prefix cache on (the default) and off (`--no-prefix-cache` added
to every node's engine flags). The same conversations are replayed on every configuration.

Per configuration: TTFT (first streamed token − send) p50 / p90 over all turns and over turns 2 and later (the ones a
prefix cache can serve), prompt tokens sent, and prefill tokens computed: the sum over the nodes of
`baton_node_prompt_tokens_total` across the run. Summary per topology, off / on: prefill tokens computed (goal
≥ 5×) and TTFT p50 (goal ≥ 3×).

Every configuration must give the same answers (greedy) in float32: the run fails when their digests differ. In
16-bit dtypes (the GPU defaults) a step's numerics depend on what it batches and on where a prefill starts, so a
near-tie can go either way: the digests are printed, not required to agree (the exactness of the prefix cache is
tested in float32).

Output: `OUT/multiturn_<config>.json` per configuration and `OUT/multiturn_summary.json`; markdown tables on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from baton.cli.cluster import Cluster  # noqa: E402
from baton.client import AsyncClient  # noqa: E402
from baton.engine.make_model import PRESET_NAMES  # noqa: E402
from benchmarks.run_info import git_commit  # noqa: E402
from benchmarks.serving_bench import FIRST_ID, MODEL_PRESETS, Percentiles, card_names, summarize  # noqa: E402

TOPOLOGIES = ("agg", "disagg")
CACHE_OFF_FLAG = "--no-prefix-cache"
PREFILL_COUNTER = "baton_node_prompt_tokens_total"
# Engine dtypes whose steps are not batch-invariant: their greedy answers may differ between configurations.
SIXTEEN_BIT = frozenset({"bfloat16", "float16"})

# Flag defaults: a GPU run (issue #51's workload on the 8b-like shape) and a CPU run on the tiny model. The GPU
# run's cache memory per node lets 1P1D's two nodes share one 80 GB card beside their two copies of the weights.
DEFAULTS: dict[str, dict[str, object]] = {
    "gpu": {
        "model_preset": "8b-like", "conversations": 200, "turns": 8, "system_tokens": 2048, "user_tokens": 64,
        "answer_min": 100, "answer_max": 300, "concurrency": 32,
        "engine_args": "--device cuda --dtype bfloat16 --max-num-seqs 64 --max-num-batched-tokens 4096 "
                       "--cache-memory-mb 16384",
        # Both nodes on one GPU: NIXL's UCX path copies each request's state through the host, CUDA IPC maps it.
        "node_args": "--cuda-ipc",
    },
    "cpu": {
        "model_preset": "small", "conversations": 16, "turns": 4, "system_tokens": 1024, "user_tokens": 64,
        "answer_min": 16, "answer_max": 48, "concurrency": 4,
        "engine_args": "--block-size 16 --max-num-seqs 8 --max-num-batched-tokens 512 --num-kv-blocks 2048",
        "node_args": "",
    },
}


@dataclass(frozen=True)
class Workload:
    conversations: int
    turns: int
    system_tokens: int
    user_tokens: int
    answer_min: int
    answer_max: int
    concurrency: int
    vocab_size: int
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("conversations", "turns", "user_tokens", "answer_min", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected at least 1, got {getattr(self, name)}")
        if self.system_tokens < 0:
            raise ValueError(f"system_tokens: expected >= 0, got {self.system_tokens}")
        if self.answer_max < self.answer_min:
            raise ValueError(f"answer_max: expected >= answer_min = {self.answer_min}, got {self.answer_max}")
        if self.vocab_size <= FIRST_ID:
            raise ValueError(f"vocab_size: expected more than {FIRST_ID} ids, got {self.vocab_size}")

    @property
    def longest_prompt(self) -> int:
        return self.system_tokens + self.turns * self.user_tokens + (self.turns - 1) * self.answer_max

    def system_prompt(self) -> list[int]:
        rng = random.Random(f"{self.seed}/system")
        return [rng.randrange(FIRST_ID, self.vocab_size) for _ in range(self.system_tokens)]

    def user_message(self, conversation: int, turn: int) -> list[int]:
        rng = random.Random(f"{self.seed}/{conversation}/{turn}/user")
        return [rng.randrange(FIRST_ID, self.vocab_size) for _ in range(self.user_tokens)]

    def answer_tokens(self, conversation: int, turn: int) -> int:
        return random.Random(f"{self.seed}/{conversation}/{turn}/answer").randint(self.answer_min, self.answer_max)


@dataclass(frozen=True)
class TurnResult:
    conversation: int
    turn: int
    prompt_tokens: int
    ttft_s: float | None
    answer: tuple[int, ...]
    error: str | None


async def run_turn(client: AsyncClient, prompt: list[int], max_tokens: int) -> tuple[float | None, list[int]]:
    """Streams one turn: (TTFT, the answer's tokens)."""
    t0 = time.perf_counter()
    ttft = None
    answer: list[int] = []
    async with client.stream(prompt, max_tokens=max_tokens, ignore_eos=True) as s:
        async for chunk in s:
            if chunk.token_ids and ttft is None:
                ttft = time.perf_counter() - t0
            answer.extend(chunk.token_ids)
    return ttft, answer


async def run_conversation(client: AsyncClient, w: Workload, c: int, bar: tqdm | None) -> list[TurnResult]:
    history = w.system_prompt()
    out = []
    for turn in range(w.turns):
        prompt = history + w.user_message(c, turn)
        want = w.answer_tokens(c, turn)
        try:
            ttft, answer = await run_turn(client, prompt, want)
            err = None if len(answer) == want else f"got {len(answer)} of {want} tokens"
        except Exception as e:  # noqa: BLE001 (a failed turn is a result; the conversation stops there)
            ttft, answer, err = None, [], f"{type(e).__name__}: {e}"
        out.append(TurnResult(c, turn, len(prompt), ttft, tuple(answer), err))
        if bar is not None:
            bar.update(1)
        if err is not None:
            break
        history = prompt + answer
    return out


async def run_workload(addr: str, w: Workload, bar: tqdm | None) -> list[TurnResult]:
    """Every conversation, `w.concurrency` at a time."""
    gate = asyncio.Semaphore(w.concurrency)
    async with AsyncClient(addr, timeout=None, retries=0) as client:
        async def one(c: int) -> list[TurnResult]:
            async with gate:
                return await run_conversation(client, w, c, bar)

        done = await asyncio.gather(*(one(c) for c in range(w.conversations)))
    return [r for conv in done for r in conv]


def metrics_texts(cluster: Cluster) -> dict[str, str]:
    """Each node's and the router's `/metrics` text, by name (`prefill-0`, ..., `router`)."""
    import urllib.request

    urls = {f"prefill-{i}": cluster.node_http_url(a) for i, a in enumerate(cluster.prefill_addrs)}
    urls |= {f"decode-{i}": cluster.node_http_url(a) for i, a in enumerate(cluster.decode_addrs)}
    urls["router"] = cluster.router_http_url
    texts = {}
    for name, url in urls.items():
        with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
            texts[name] = resp.read().decode()
    return texts


def prefill_tokens(texts: dict[str, str]) -> float:
    """`baton_node_prompt_tokens_total` summed over the nodes' `/metrics` texts."""
    total = 0.0
    for name, text in texts.items():
        if name == "router":
            continue
        values = [line.split()[-1] for line in text.splitlines() if line.startswith(PREFILL_COUNTER + " ")]
        if not values:
            raise ValueError(f"{name}: expected the counter {PREFILL_COUNTER} in its /metrics, got none")
        total += float(values[0])
    return total


@dataclass(frozen=True)
class ConfigResult:
    name: str
    topology: str
    cache: bool
    turns_completed: int
    turns_failed: int  # (a failed turn ends its conversation: the turns not sent after it count too)
    errors: tuple[str, ...]
    prompt_tokens_sent: int
    prefill_tokens_computed: float
    ttft_s: Percentiles | None
    ttft_later_turns_s: Percentiles | None
    wall_s: float
    # sha256 of every turn's answer tokens in (conversation, turn) order: greedy answers are the same whatever the
    # cache setting and topology, so configurations that served the same conversations agree on it.
    answers_sha256: str


def run_config(model_dir: Path, topology: str, cache: bool, w: Workload, engine_args: Sequence[str],
               log_dir: Path | None, progress: bool, node_args: Sequence[str] = ()) -> ConfigResult:
    name = f"{topology}-{'cache' if cache else 'nocache'}"
    args = tuple(engine_args) + (() if cache else (CACHE_OFF_FLAG,))
    cluster = Cluster(str(model_dir), prefill_workers=1 if topology == "disagg" else 0, decode_workers=1,
                      local_prefill_threshold=0 if topology == "disagg" else 2**31 - 1, engine_args=args,
                      node_args=tuple(node_args), log_dir=str(log_dir / name) if log_dir else None)
    with cluster, tqdm(total=w.conversations * w.turns, desc=name, disable=not progress, file=sys.stderr) as bar:
        before = prefill_tokens(metrics_texts(cluster))
        t = time.perf_counter()
        results = asyncio.run(run_workload(cluster.router_addr, w, bar))
        wall = time.perf_counter() - t
        after = metrics_texts(cluster)
        computed = prefill_tokens(after) - before
        if log_dir:
            # Where the time went (step durations, transfers, queue depths) is in the counters the run leaves.
            for node, text in after.items():
                (log_dir / name / f"{node}.metrics").write_text(text)
    ok = [r for r in results if r.error is None]
    return ConfigResult(
        name, topology, cache, len(ok), w.conversations * w.turns - len(ok),
        tuple(sorted({r.error for r in results if r.error is not None}))[:5], sum(r.prompt_tokens for r in results),
        computed, summarize([r.ttft_s for r in ok if r.ttft_s is not None]),
        summarize([r.ttft_s for r in ok if r.ttft_s is not None and r.turn > 0]), wall, answers_digest(results))


def answers_digest(results: Sequence[TurnResult]) -> str:
    h = hashlib.sha256()
    for r in sorted(results, key=lambda r: (r.conversation, r.turn)):
        h.update(json.dumps([r.conversation, r.turn, list(r.answer)]).encode())
    return h.hexdigest()


@dataclass(frozen=True)
class Ratio:
    topology: str
    prefill_tokens_off_over_on: float | None
    ttft_p50_off_over_on: float | None


def ratios(results: Sequence[ConfigResult]) -> list[Ratio]:
    """Per topology with both cache settings run: off / on of the prefill tokens computed and of TTFT p50."""
    by = {(r.topology, r.cache): r for r in results}
    out = []
    for topo in TOPOLOGIES:
        on, off = by.get((topo, True)), by.get((topo, False))
        if on is None or off is None:
            continue
        tokens = off.prefill_tokens_computed / on.prefill_tokens_computed if on.prefill_tokens_computed else None
        ttft = off.ttft_s.p50 / on.ttft_s.p50 if on.ttft_s and off.ttft_s and on.ttft_s.p50 else None
        out.append(Ratio(topo, tokens, ttft))
    return out


def _ms(p: Percentiles | None) -> str:
    return "–" if p is None else f"{p.p50 * 1e3:.1f} / {p.p90 * 1e3:.1f}"


def table(results: Sequence[ConfigResult], rs: Sequence[Ratio]) -> str:
    lines = ["| config | turns ok / failed | prompt tokens sent | prefill tokens computed | TTFT p50 / p90 ms | "
             "turns 2+ TTFT p50 / p90 ms |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        lines.append(f"| {r.name} | {r.turns_completed} / {r.turns_failed} | {r.prompt_tokens_sent} | "
                     f"{r.prefill_tokens_computed:.0f} | {_ms(r.ttft_s)} | {_ms(r.ttft_later_turns_s)} |")
    if rs:
        lines += ["", "| topology | prefill tokens off / on (goal ≥ 5×) | TTFT p50 off / on (goal ≥ 3×) |",
                  "| --- | ---: | ---: |"]
        for x in rs:
            tok = "–" if x.prefill_tokens_off_over_on is None else f"{x.prefill_tokens_off_over_on:.2f}×"
            ttft = "–" if x.ttft_p50_off_over_on is None else f"{x.ttft_p50_off_over_on:.2f}×"
            lines.append(f"| {x.topology} | {tok} | {ttft} |")
    return "\n".join(lines)


def ensure_model(preset: str, model_dir: Path, device: str) -> int:
    """Writes the preset's checkpoint unless `model_dir` holds it already; returns its vocabulary size."""
    from baton.engine.loader import read_hf_config
    from baton.engine.make_model import make_model

    base, overrides = MODEL_PRESETS.get(preset, (preset, {}))
    marker = model_dir / "multiturn_bench_model.json"
    if not (marker.exists() and marker.read_text() == preset):
        make_model(model_dir, preset=base, seed=0, overrides=overrides, progress=False, tokenizer=False, device=device)
        marker.write_text(preset)
    return int(read_hf_config(model_dir)["vocab_size"])


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpu", action="store_true", help="GPU defaults (8b-like, issue #51's workload); else the CPU ones")
    p.add_argument("--model-preset", choices=sorted({*PRESET_NAMES, *MODEL_PRESETS}),
                   help="make-model's presets and serving_bench's (GPU default 8b-like, CPU small)")
    p.add_argument("--model-dir", type=Path, help="checkpoint directory (default TMP/baton-multiturn-PRESET)")
    for name in ("conversations", "turns", "system-tokens", "user-tokens", "answer-min", "answer-max", "concurrency"):
        p.add_argument(f"--{name}", type=int)
    p.add_argument("--engine-args", help="engine flags of every node (the cache setting is added per configuration)")
    p.add_argument("--node-args", help="node flags of every node that are not engine flags (GPU default --cuda-ipc)")
    p.add_argument("--configs", default="agg-cache,agg-nocache,disagg-cache,disagg-nocache",
                   help="comma-separated TOPOLOGY-cache / TOPOLOGY-nocache, TOPOLOGY in agg, disagg")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write the JSON results here")
    p.add_argument("--log-dir", type=Path, default=None, help="node and router logs (default: none kept)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    for k, v in DEFAULTS["gpu" if args.gpu else "cpu"].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    configs = []
    for c in args.configs.split(","):
        topo, _, cache = c.strip().rpartition("-")
        if topo not in TOPOLOGIES or cache not in ("cache", "nocache"):
            raise ValueError(f"--configs: expected TOPOLOGY-cache or TOPOLOGY-nocache with TOPOLOGY in "
                             f"{', '.join(TOPOLOGIES)}, got {c!r}")
        configs.append((topo, cache == "cache"))
    args.config_list = configs
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = args.model_dir or Path(tempfile.gettempdir()) / f"baton-multiturn-{args.model_preset}"
    vocab = ensure_model(args.model_preset, model_dir, "cuda" if args.gpu else "cpu")
    w = Workload(args.conversations, args.turns, args.system_tokens, args.user_tokens, args.answer_min,
                 args.answer_max, args.concurrency, vocab, args.seed)
    engine_args = tuple(args.engine_args.split()) + ("--max-model-len", str(w.longest_prompt + args.answer_max + 1))
    results = []
    for topo, cache in args.config_list:
        r = run_config(model_dir, topo, cache, w, engine_args, args.log_dir, not args.no_progress,
                       tuple(args.node_args.split()))
        results.append(r)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"multiturn_{r.name}.json").write_text(json.dumps(asdict(r), indent=1))
    rs = ratios(results)
    if args.out:
        (args.out / "multiturn_summary.json").write_text(json.dumps(
            dict(commit=git_commit(), cards=card_names(), workload=asdict(w), engine_args=engine_args,
                 results=[asdict(r) for r in results], ratios=[asdict(x) for x in rs]), indent=1))
    print(f"commit {git_commit()}, {', '.join(card_names()) or 'CPU'}, {args.model_preset}: {w.conversations} "
          f"conversations x {w.turns} turns, system prompt {w.system_tokens} tokens, user {w.user_tokens}, answers "
          f"{w.answer_min}-{w.answer_max}, {w.concurrency} at once")
    print(table(results, rs))
    if len({r.answers_sha256 for r in results}) > 1:
        exact = not SIXTEEN_BIT & set(engine_args)
        print(("answers differ between configurations: " if exact else "answers (16-bit steps, not compared): ")
              + ", ".join(f"{r.name} {r.answers_sha256[:12]}" for r in results))
        if exact:
            return 1
    return 0 if all(r.turns_failed == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
