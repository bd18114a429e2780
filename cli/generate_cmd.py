"""`baton generate`: serve token-id prompts together in one offline engine."""

from __future__ import annotations

import argparse
import json
import sys
import time

from baton.node.engine_args import (
    add_engine_args,
    add_sampling_args,
    engine_config_from_args,
    parse_ids,
    sampling_from_args,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate from token-id prompts with the offline engine")
    p.add_argument("--model", required=True, help="HF NemotronH checkpoint directory")
    p.add_argument("--prompt-ids", type=parse_ids, action="append", required=True,
                   help='a prompt as token ids, e.g. "1 2 3"; repeat for more prompts (served together)')
    p.add_argument("--json", action="store_true", help="one JSON object per prompt, in input order")
    add_sampling_args(p)
    add_engine_args(p)
    p.set_defaults(run=run)


def run(a: argparse.Namespace) -> int:
    from baton.engine.parallel.rank_processes import start_engine

    params = sampling_from_args(a)
    engine = start_engine(a.model, engine_config_from_args(a))
    t0 = time.perf_counter()
    try:
        outs = engine.generate(a.prompt_ids, params)
    finally:
        engine.close()
    dt = time.perf_counter() - t0
    for o in outs:
        if a.json:
            print(json.dumps({"prompt_ids": list(o.prompt_token_ids), "token_ids": list(o.token_ids),
                              "finish_reason": o.finish_reason,
                              "spec": {"drafted": o.num_drafted, "accepted": o.num_accepted}}))
        else:
            print(f"{list(o.prompt_token_ids)} -> {list(o.token_ids)} ({o.finish_reason})")
    n = sum(len(o.token_ids) for o in outs)
    s = engine.stats
    spec = ""
    if engine.config.num_speculative_tokens:
        spec = (f"; MTP: {s.spec_drafted} drafted, {s.spec_accepted} accepted, "
                f"mean acceptance length {s.mean_acceptance_length:.2f}")
    print(f"{len(outs)} prompts, {n} tokens in {dt:.2f} s ({n / dt:.1f} tok/s), {s.steps} steps, "
          f"{s.mixed_steps} mixed{spec}", file=sys.stderr)
    return 0
