"""The tokens an engine emits for a fixed workload under each of its step paths, to compare two commits' engines
token for token (a refactor must not change one).

The workload: prompts of 3 to ~`--max-prompt` tokens (some longer than a step's budget: chunked), greedy rows and
rows sampled at a temperature with a seed (their noise depends on seed and position only), served together so that
steps mix decode rows and prompt chunks. Each config below runs it on a fresh engine over the same checkpoint:

  k0            K = 0, the engine's defaults (async scheduling, CUDA graphs and mixed-step graphs on a GPU)
  k0_sync       K = 0, one step at a time, no CUDA graphs
  k2            K = 2 MTP drafts (async: verify steps chained on the device where they can be)
  k2_sync       K = 2, one step at a time, no CUDA graphs
  disagg_k0/k2  a prefill-only engine computes N-1 tokens, its caches are copied into a decode engine's
                (`add_computed_request`), which decodes from token N (R1), as the nodes do over a transfer

  python benchmarks/greedy_tokens.py --model DIR --out a.json                 # on the commit to compare
  python benchmarks/greedy_tokens.py --compare a.json b.json                  # prints the table, exit 1 if any differs
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIGS = ("k0", "k0_sync", "k2", "k2_sync", "disagg_k0", "disagg_k2")


def workload(vocab: int, n: int, max_prompt: int, max_tokens: int, seed: int = 0):
    from baton.engine.sampling_params import SamplingParams

    rng = random.Random(seed)
    prompts, params = [], []
    for i in range(n):
        length = rng.randint(3, max_prompt)
        prompts.append([rng.randrange(3, vocab) for _ in range(length)])
        sampled = i % 3 == 2
        params.append(SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.8 if sampled else 0.0,
                                     seed=1000 + i if sampled else None))
    return prompts, params


def engine_config(name: str, device: str, base):
    k = 2 if name.endswith("k2") or name.startswith("k2") else 0
    cfg = replace(base, device=device, num_speculative_tokens=k)
    if name.endswith("_sync"):
        cfg = replace(cfg, async_scheduling=False, cuda_graphs=False)
    return cfg


def run_config(name: str, model: str, device: str, prompts, params, base) -> list[list[int]]:
    from baton.engine.llm_engine import LLMEngine

    cfg = engine_config(name, device, base)
    if not name.startswith("disagg"):
        engine = LLMEngine.from_pretrained(model, cfg)
        return [list(o.token_ids) for o in engine.generate(prompts, params)]
    return run_disagg(model, cfg, prompts, params)


def run_disagg(model: str, cfg, prompts, params) -> list[list[int]]:
    """Prefill N-1 tokens on one engine, copy the caches into the other's pools, decode there."""
    from baton.engine.llm_engine import LLMEngine

    prefill = LLMEngine.from_pretrained(model, replace(cfg, prefill_only=True))
    decode = LLMEngine.from_pretrained(model, cfg)
    out: dict[str, list[int]] = {}
    for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
        if len(prompt) < 2:
            out[str(i)] = list(decode.generate([prompt], sp)[0].token_ids)
            continue
        rid = prefill.add_request(prompt, sp, request_id=f"p{i}", prefill_only=True)
        held = None
        while held is None:
            held = next((o for o in prefill.step() if o.request_id == rid and o.finished), None)
        got = decode.reserve(len(prompt) - 1)
        if got is None:
            raise RuntimeError("decode engine: no room for a transferred request")
        blocks, slot = got
        src_pools, dst_pools = prefill.pools.by_name(), decode.pools.by_name()
        for pool_name, src in src_pools.items():
            dst = dst_pools[pool_name]
            if pool_name == "kv":
                dst[blocks] = src[list(held.held_block_ids)[:len(blocks)]]
            else:
                dst[slot] = src[held.held_state_slot]
        prefill.free_held(held.held_block_ids, held.held_state_slot)
        decode.add_computed_request(prompt, sp, str(i), blocks, slot, len(prompt) - 1)
        while decode.has_unfinished():
            for o in decode.step():
                if o.finished:
                    out[o.request_id] = list(o.token_ids)
    return [out[str(i)] for i in range(len(prompts))]


def compare(a_path: str, b_path: str) -> int:
    a, b = json.loads(Path(a_path).read_text()), json.loads(Path(b_path).read_text())
    print(f"| config | requests | identical | A ({a['commit']}) | B ({b['commit']}) |")
    print("|---|---|---|---|---|")
    bad = 0
    for name in a["tokens"]:
        ta, tb = a["tokens"][name], b["tokens"].get(name)
        same = tb is not None and sum(x == y for x, y in zip(ta, tb, strict=False))
        ok = tb is not None and same == len(ta) == len(tb)
        bad += not ok
        print(f"| {name} | {len(ta)} | {same if tb is not None else 'missing'} | "
              f"{sum(map(len, ta))} tokens | {sum(map(len, tb or []))} tokens |")
    print("identical" if not bad else f"{bad} config(s) differ")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory (make-model; with MTP layers for the k2 configs)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--max-prompt", type=int, default=600)
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--out", help="JSON file of the tokens per config")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two --out files instead")
    args = ap.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    if not args.model or not args.out:
        ap.error("--model and --out are required (or --compare A B)")
    names = [c for c in args.configs.split(",") if c]
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        ap.error(f"--configs: expected names of {', '.join(CONFIGS)}, got {', '.join(unknown)}")

    from baton.engine.config import ModelConfig
    from baton.engine.engine_config import EngineConfig
    from baton.engine.loader import read_hf_config
    from benchmarks.run_info import git_commit

    vocab = ModelConfig.from_hf_dict(read_hf_config(args.model)).vocab_size
    prompts, params = workload(vocab, args.requests, args.max_prompt, args.max_tokens)
    # Pools of a fixed size: the disaggregated configs hold two engines on one device at once.
    base = EngineConfig(block_size=16, max_num_batched_tokens=256, max_num_seqs=16,
                        cache_memory_bytes=None if args.device == "cpu" else 4 << 30)
    tokens = {}
    for name in names:
        tokens[name] = run_config(name, args.model, args.device, prompts, params, base)
        print(f"{name}: {len(tokens[name])} requests, {sum(map(len, tokens[name]))} tokens", flush=True)
    Path(args.out).write_text(json.dumps({"commit": git_commit(), "tokens": tokens}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
