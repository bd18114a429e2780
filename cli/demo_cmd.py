"""`baton demo`: serve sample prompts through the engine, streaming tokens and reporting throughput.

Until the disaggregated path exists (issue #4) this runs the offline engine in this process.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from baton.cli.engine_args import add_engine_args, engine_config_from_args

PROMPT_LENGTHS = (1, 2, 7, 16, 17, 33, 100, 250)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="serve sample prompts and print streamed output and throughput")
    p.add_argument("--model", required=True)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    add_engine_args(p)
    p.set_defaults(run=run)


def run(a: argparse.Namespace) -> int:
    from baton.engine.llm_engine import LLMEngine
    from baton.engine.sampling_params import SamplingParams

    t_load = time.perf_counter()
    engine = LLMEngine.from_pretrained(a.model, engine_config_from_args(a))
    cfg = engine.model_config
    print(f"loaded {a.model}: pattern {cfg.pattern}, vocab {cfg.vocab_size}, {engine.plan.num_blocks} KV blocks, "
          f"{engine.plan.num_slots} state slots ({time.perf_counter() - t_load:.1f} s)")
    rng = random.Random(a.seed)
    prompts = [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]
    # Half greedy, half seeded sampling; requests arrive one every other step, so prefill chunks of new
    # prompts share forward passes with the decode rows of earlier ones (mixed batches).
    params = [SamplingParams(max_tokens=a.max_tokens, ignore_eos=True, **(
        {} if i % 2 == 0 else {"temperature": 0.8, "top_p": 0.95, "seed": a.seed + i}))
        for i in range(len(prompts))]
    t0 = time.perf_counter()
    arrived: dict[str, float] = {}
    first: dict[str, float] = {}
    step = 0
    while step < 2 * len(prompts) or engine.has_unfinished():
        if step % 2 == 0 and step // 2 < len(prompts):
            i = step // 2
            arrived[engine.add_request(prompts[i], params[i], request_id=f"demo-{i}")] = time.perf_counter()
        for o in engine.step():
            first.setdefault(o.request_id, time.perf_counter() - arrived[o.request_id])
            print(f"[{o.request_id}] +{list(o.new_token_ids)}" + (f"  <{o.finish_reason}>" if o.finished else ""))
            sys.stdout.flush()
        step += 1
    wall = time.perf_counter() - t0
    s = engine.stats
    gen = a.max_tokens * len(prompts)
    print(f"\n{len(prompts)} requests (prompt lengths {list(PROMPT_LENGTHS)}), {s.steps} steps "
          f"({s.mixed_steps} mixed prefill+decode), {s.preemptions} preemptions")
    print(f"TTFT mean {1000 * sum(first.values()) / len(first):.0f} ms; "
          f"prefill {s.prompt_tokens} tok, generated {gen} tok in {wall:.2f} s -> "
          f"{gen / wall:.1f} output tok/s, {(gen + s.prompt_tokens) / wall:.1f} total tok/s")
    return 0
