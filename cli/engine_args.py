"""Engine and sampling flags shared by the commands that run an engine."""

from __future__ import annotations

import argparse

from baton.engine.engine_config import SUPPORTED_DTYPES, EngineConfig
from baton.engine.sampling_params import SamplingParams


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--max-num-seqs", type=int, default=32, help="running requests at most (= state slots)")
    g.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget of one step")
    g.add_argument("--long-prefill-token-threshold", type=int, default=None, help="cap on one prefill chunk")
    g.add_argument("--cache-memory-mb", type=int, default=256, help="KV + state pool budget in MiB")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks (overrides --cache-memory-mb)")
    g.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output")
    g.add_argument("--dtype", choices=SUPPORTED_DTYPES, default="auto")
    g.add_argument("--device", default="cpu")


def engine_config_from_args(a: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        block_size=a.block_size, max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
        long_prefill_token_threshold=a.long_prefill_token_threshold,
        cache_memory_bytes=a.cache_memory_mb * 2**20, num_kv_blocks=a.num_kv_blocks,
        max_model_len=a.max_model_len, dtype=a.dtype, device=a.device)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--seed", type=int, default=None, help="per-request seed (each prompt gets this seed)")
    g.add_argument("--stop-token-ids", type=parse_ids, default=(), help='e.g. "5 7"')
    g.add_argument("--ignore-eos", action="store_true")


def sampling_from_args(a: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                          seed=a.seed, stop_token_ids=tuple(a.stop_token_ids), ignore_eos=a.ignore_eos)


def parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected space-separated token ids, got {text!r}") from None
