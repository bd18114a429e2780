"""`baton demo`: start router + prefill + decode on this machine, stream sample prompts through the whole
disaggregated path, and print each request's streamed output, TTFT and throughput; then shut down."""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time

from baton.cli.cluster import Cluster
from baton.cli.up_cmd import shared_gpu_flags, visible_gpus
from baton.node.engine_args import add_engine_args, engine_flags

TEXT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "import numpy as np\n\nclass Model:",
    "In a hybrid Mamba model, the recurrent state",
)
ID_PROMPT_LENGTHS = (1, 2, 17, 100, 250)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="serve sample prompts through router -> prefill -> decode; print the streams")
    p.add_argument("--model", required=True)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefill-workers", type=int, default=1)
    p.add_argument("--decode-workers", type=int, default=1)
    p.add_argument("--log-dir", default=None)
    add_engine_args(p)
    p.set_defaults(run=run)


def run(a: argparse.Namespace) -> int:
    print(_intro(a), flush=True)
    t0 = time.perf_counter()
    # On a GPU machine the nodes share GPU 0, each with its share of the memory.
    shared = shared_gpu_flags(a, a.prefill_workers + a.decode_workers, (), visible_gpus(a.device))
    with Cluster(a.model, prefill_workers=a.prefill_workers, decode_workers=a.decode_workers,
                 engine_args=tuple(engine_flags(a)) + shared, log_dir=a.log_dir) as cluster:
        print(f"started router {cluster.router_addr}, prefill {cluster.prefill_addrs}, decode "
              f"{cluster.decode_addrs} in {time.perf_counter() - t0:.1f} s", flush=True)
        code = asyncio.run(_serve(cluster.router_addr, a))
    print(NEXT, flush=True)
    return code


def _intro(a: argparse.Namespace) -> str:
    return f"""\
Baton demo
==========
This starts a router, {a.prefill_workers} prefill node(s) and {a.decode_workers} decode node(s) on this machine, as \
separate processes, and sends
a few prompts through them at once. Each request takes the disaggregated path:
  client -> router -> prefill node (computes the first N-1 prompt tokens; never samples)
         -> NIXL (the decode node pulls the KV blocks and the Mamba state)
         -> decode node (computes token N, then streams the output back through the router).
A one-token prompt has nothing to hand over: the decode node prefills it itself.

Model: {a.model}. `make demo` writes it with `baton make-model`, which draws random weights, so the
text generated below is arbitrary. That is expected: the demo shows the serving path, not a language model.
"""


NEXT = """
next: serve a real checkpoint: `baton up --model /path/to/hf-checkpoint`
      README.md "Serve your checkpoint on GPUs" and "APIs" (gRPC SDK, OpenAI HTTP); every flag: docs/cli.md"""


async def _serve(addr: str, a: argparse.Namespace) -> int:
    from baton.client import AsyncClient

    async with AsyncClient(addr) as client:
        info = await client.model_info()
        rng = random.Random(a.seed)
        prompts: list[list[int] | str] = list(TEXT_PROMPTS) if info.has_tokenizer else []
        prompts += [[rng.randrange(3, info.vocab_size) for _ in range(n)] for n in ID_PROMPT_LENGTHS]
        print(f"model {info.model} ({info.layer_pattern}, vocab {info.vocab_size}); {len(prompts)} requests "
              f"at once,\neven-numbered greedy, odd-numbered seeded top-p sampling, {a.max_tokens} tokens each. "
              f"Each line below is one streamed\nmessage: [request, prompt] its text (or its token ids); a "
              f"request's last message carries its finish reason in angle brackets.\n", flush=True)
        t_start = time.perf_counter()
        results = await asyncio.gather(*(_one(client, i, p, a, t_start) for i, p in enumerate(prompts)))
        wall = time.perf_counter() - t_start
    ttfts = [r[0] for r in results]
    n_out = sum(r[1] for r in results)
    # The streams above interleave; each request's whole output, once, is easier to read.
    print("\nEach request's whole output:", flush=True)
    for i, (prompt, r) in enumerate(zip(prompts, results, strict=True)):
        print(f"  [{i} {_label(prompt)}] -> {_shorten(r[2])}", flush=True)
    print(f"\n{len(prompts)} requests through router -> prefill -> NIXL -> decode: {n_out} tokens in {wall:.2f} s "
          f"= {n_out / wall:.1f} output tok/s; time to first token (TTFT) p50 "
          f"{1000 * statistics.median(ttfts):.0f} ms, max {1000 * max(ttfts):.0f} ms", flush=True)
    return 0


def _label(prompt: list[int] | str) -> str:
    return repr(prompt[:40]) if isinstance(prompt, str) else f"{len(prompt)} token ids"


def _shorten(shown: str, width: int = 90) -> str:
    return shown if len(shown) <= width else shown[:width - 3] + "..."


async def _one(client, i: int, prompt, a: argparse.Namespace, t_start: float) -> tuple[float, int, str]:
    """Streams one request, printing each message; returns its time to first token, its token count and its
    whole output as shown (the text's repr, or the token ids without a tokenizer)."""
    sampling = {} if i % 2 == 0 else {"temperature": 0.8, "top_p": 0.95, "seed": a.seed + i}
    label = _label(prompt)
    first = None
    n = 0
    pieces: list[str] = []
    ids: list[int] = []
    async for chunk in client.stream(prompt, max_tokens=a.max_tokens, ignore_eos=True, **sampling):
        first = first if first is not None else time.perf_counter() - t_start
        n += len(chunk.token_ids)
        pieces.append(chunk.text)
        ids += chunk.token_ids
        shown = repr(chunk.text) if chunk.text else list(chunk.token_ids)
        end = f"  <{chunk.finish_reason}>" if chunk.finish_reason else ""
        print(f"[{i} {label}] {shown}{end}", flush=True)
    sys.stdout.flush()
    text = "".join(pieces)
    return (first if first is not None else 0.0), n, repr(text) if text else str(ids)
