"""Serve a checkpoint through `baton up` exactly as a user starts it, under closed-loop load, and say where the
first-token time goes.

Each variant is one `baton up --model M <flags>` process (its own defaults decide device, pool sizes, layout and
transfer path); once its router answers, `--requests` requests (prompts of uniform random length in
[`--prompt-min`, `--prompt-max`] tokens, `--max-tokens` tokens out, greedy, ignore_eos) go through the gRPC SDK
with at most `--concurrency` in flight. Per variant: requests completed, TTFT p50/p90/p99, the mean time per
output token, output tokens/s over the wall time, and from the nodes' /metrics: the mean NIXL/IPC transfer time,
bytes a transfer, and the prefill and decode nodes' step time and GPU-busy share.

  python benchmarks/serve_check.py --model M --variants 'default|' 'p1d1-ipc|--prefill-workers 1' --out DIR

A variant is NAME|FLAGS, or NAME|FLAGS|VAR=VALUE ... to start that `baton up` with environment variables set
(e.g. UCX_TLS for the NIXL path). Results: one JSON per variant under --out and a table on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

READY_S = 600.0
LINE = re.compile(r"router on (\S+) \(metrics (\S+)/metrics\); prefill \[(.*?)\]; decode \[(.*?)\]")


@dataclass
class Load:
    requests: int = 256
    concurrency: int = 64
    prompt_min: int = 64
    prompt_max: int = 1024
    max_tokens: int = 128
    vocab: int = 1000
    seed: int = 0


@dataclass
class Result:
    name: str
    flags: str
    requests: int
    completed: int
    errors: list[str]
    wall_s: float
    output_tokens: int
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    tpot_mean_ms: float
    output_tokens_per_s: float
    startup_s: float
    metrics: dict[str, float] = field(default_factory=dict)
    log_tail: str = ""


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _scrape(url: str) -> dict[str, float]:
    """Sums of every sample of a /metrics page, by sample name (labels summed over)."""
    out: dict[str, float] = {}
    with urllib.request.urlopen(url, timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name, _, value = line.rpartition(" ")
            name = name.split("{", 1)[0]
            try:
                out[name] = out.get(name, 0.0) + float(value)
            except ValueError:
                continue
    return out


def _node_http(addr: str) -> str:
    host, _, port = addr.strip().strip("'").rpartition(":")
    return f"http://{host}:{int(port) + 2000}/metrics"


async def _load(addr: str, load: Load) -> tuple[list[float], list[float], int, list[str], float]:
    from baton.client import AsyncClient

    rng = random.Random(load.seed)
    prompts = [[rng.randrange(3, load.vocab) for _ in range(rng.randint(load.prompt_min, load.prompt_max))]
               for _ in range(load.requests)]
    sem = asyncio.Semaphore(load.concurrency)
    ttfts: list[float] = []
    tpots: list[float] = []
    errors: list[str] = []
    tokens = 0

    async with AsyncClient(addr, timeout=600.0) as client:
        async def one(prompt: list[int]) -> None:
            nonlocal tokens
            async with sem:
                t0 = time.perf_counter()
                first = None
                n = 0
                reason = None
                try:
                    async with client.stream(prompt, max_tokens=load.max_tokens, ignore_eos=True) as s:
                        async for chunk in s:
                            if chunk.token_ids and first is None:
                                first = time.perf_counter() - t0
                            n += len(chunk.token_ids)
                            reason = chunk.finish_reason or reason
                except Exception as e:  # a failed request is counted and named, never hidden
                    errors.append(f"{type(e).__name__}: {e}"[:300])
                    return
                e2e = time.perf_counter() - t0
                if n != load.max_tokens or reason != "length":
                    errors.append(f"got {n} tokens, finish {reason!r}")
                    return
                tokens += n
                ttfts.append(first if first is not None else e2e)
                if n > 1:
                    tpots.append((e2e - ttfts[-1]) / (n - 1))

        t0 = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - t0
    return ttfts, tpots, tokens, errors, wall


def run_variant(model: str, name: str, flags: str, load: Load, log_dir: Path, env: str = "") -> Result:
    """Start `baton up --model model flags` (with `env`'s VAR=VALUE words set), load it, scrape its nodes, stop
    it."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    argv = [sys.executable, "-m", "baton.cli.main", "up", "--model", model, "--log-dir", str(log_dir / name),
            *shlex.split(flags)]
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True,
                                env={**os.environ, **dict(w.split("=", 1) for w in shlex.split(env))})
        addr = http = None
        prefill: list[str] = []
        decode: list[str] = []
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                log.flush()
                if m := LINE.search(line):
                    addr, http = m.group(1), m.group(2)
                    prefill = [a for a in m.group(3).split(",") if a.strip()]
                    decode = [a for a in m.group(4).split(",") if a.strip()]
                    break
                if time.perf_counter() - t0 > READY_S:
                    break
            startup = time.perf_counter() - t0
            if addr is None:
                proc.wait(10)
                tail = log_path.read_text()[-3000:]
                return Result(name, flags, load.requests, 0, ["baton up did not start"], 0.0, 0, *[float("nan")] * 5,
                              startup, log_tail=tail + _node_logs(log_dir / name))
            ttfts, tpots, tokens, errors, wall = asyncio.run(_load(addr, load))
            metrics: dict[str, float] = {}
            for role, addrs in (("prefill", prefill), ("decode", decode)):
                for a in addrs:
                    for k, v in _scrape(_node_http(a)).items():
                        metrics[f"{role}.{k}"] = metrics.get(f"{role}.{k}", 0.0) + v
            for k, v in _scrape(f"{http}/metrics").items():
                metrics[f"router.{k}"] = v
        finally:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    return Result(name, flags, load.requests, len(ttfts), errors[:10], wall, tokens, _pct(ttfts, 0.5),
                  _pct(ttfts, 0.9), _pct(ttfts, 0.99), 1000 * statistics.fmean(tpots) if tpots else float("nan"),
                  tokens / wall if wall else 0.0, startup, metrics,
                  log_tail="" if len(ttfts) == load.requests else _node_logs(log_dir / name))


def _node_logs(folder: Path) -> str:
    return "".join(f"\n--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(folder.glob("*.log")))


def _where(r: Result) -> str:
    """Where the time went, from the nodes' counters."""
    m = r.metrics

    def per(num: str, den: str) -> float:
        return m.get(num, 0.0) / m[den] if m.get(den) else float("nan")

    parts = [f"transfers {m.get('decode.baton_node_transfers_total', 0):.0f}",
             f"{1000 * per('decode.baton_node_transfer_seconds_total', 'decode.baton_node_transfers_total'):.1f} ms "
             f"and {per('decode.baton_node_transfer_bytes_total', 'decode.baton_node_transfers_total') / 2**20:.0f} "
             "MiB each"]
    for role in ("prefill", "decode"):
        steps = m.get(f"{role}.baton_node_engine_steps_total")
        if steps:
            parts.append(f"{role} {steps:.0f} steps of "
                         f"{1000 * per(f'{role}.baton_node_step_duration_seconds_sum', f'{role}.baton_node_engine_steps_total'):.1f} ms, "
                         f"GPU busy {m.get(f'{role}.baton_node_step_device_seconds_total', 0) / r.wall_s:.0%}"
                         if r.wall_s else "")
    return "; ".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--variants", nargs="+", default=["default|"], help="NAME|FLAGS (baton up flags)")
    ap.add_argument("--requests", type=int, default=Load.requests)
    ap.add_argument("--concurrency", type=int, default=Load.concurrency)
    ap.add_argument("--prompt-min", type=int, default=Load.prompt_min)
    ap.add_argument("--prompt-max", type=int, default=Load.prompt_max)
    ap.add_argument("--max-tokens", type=int, default=Load.max_tokens)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    vocab = json.loads((Path(a.model) / "config.json").read_text())["vocab_size"]
    load = Load(a.requests, a.concurrency, a.prompt_min, a.prompt_max, a.max_tokens, vocab)
    a.out.mkdir(parents=True, exist_ok=True)
    print(f"{a.requests} requests, concurrency {a.concurrency}, prompts {a.prompt_min}-{a.prompt_max} tokens, "
          f"{a.max_tokens} out; commit {os.environ.get('BATON_COMMIT', '?')}", flush=True)
    print("| variant | flags | completed | TTFT p50 / p90 / p99 s | TPOT ms | out tok/s | wall s | start s |")
    print("| --- | --- | ---: | --- | ---: | ---: | ---: | ---: |", flush=True)
    ok = True
    for spec in a.variants:
        name, _, rest = spec.partition("|")
        flags, _, env = rest.partition("|")
        r = run_variant(a.model, name, flags, load, a.out / "logs", env)
        (a.out / f"{name}.json").write_text(json.dumps({**asdict(r), "env": env, "load": asdict(load)}, indent=1))
        print(f"| {name} | `{flags}{' ' + env if env else ''}` | {r.completed}/{r.requests} | {r.ttft_p50_s:.2f} / {r.ttft_p90_s:.2f} / "
              f"{r.ttft_p99_s:.2f} | {r.tpot_mean_ms:.1f} | {r.output_tokens_per_s:.0f} | {r.wall_s:.1f} | "
              f"{r.startup_s:.0f} |", flush=True)
        print(f"  {name}: {_where(r)}", flush=True)
        for log in sorted((a.out / "logs" / name).glob("*.log")):
            for line in log.read_text().splitlines():
                if "engine on" in line:
                    print(f"  {log.stem}: {line}", flush=True)
        if r.errors:
            print(f"  {name} errors: {r.errors}\n{r.log_tail[-4000:]}", flush=True)
        ok &= r.completed == r.requests
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
