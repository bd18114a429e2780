"""Engine and sampling flags shared by the commands that run an engine."""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Sequence
from typing import Any

from baton.engine.engine_config import (
    KERNEL_MODES,
    KV_CACHE_DTYPES,
    MAX_SPECULATIVE_TOKENS,
    SUPPORTED_DTYPES,
    EngineConfig,
)
from baton.engine.memory_budget import AUTO_MAX_NUM_SEQS, CPU_CACHE_MEMORY_BYTES, CPU_MAX_NUM_SEQS
from baton.engine.sampling_params import SamplingParams


def add_engine_args(p: argparse.ArgumentParser, max_num_batched_tokens: int | None = None) -> None:
    """`max_num_batched_tokens`: this command's step budget when the flag is left out (a prefill node's), instead
    of `EngineConfig`'s."""
    g = p.add_argument_group("engine")
    d = EngineConfig()
    g.add_argument("--block-size", type=int, help=f"tokens per KV block ({d.block_size})")
    g.add_argument("--max-num-seqs", type=int,
                   help="running requests at most, = state slots (default: on a GPU what the pools hold, at most "
                        f"{AUTO_MAX_NUM_SEQS} and as many as fill half the step budget; on a CPU {CPU_MAX_NUM_SEQS})")
    g.add_argument("--max-num-batched-tokens", type=int, default=max_num_batched_tokens,
                   help=f"token budget of one step ({max_num_batched_tokens or d.max_num_batched_tokens})")
    g.add_argument("--long-prefill-token-threshold", type=int, help="cap on one prefill chunk (none)")
    g.add_argument("--cache-memory-mb", type=int,
                   help="KV + state pool budget in MiB (default: on a GPU what --gpu-memory-utilization leaves after "
                        f"weights, activations and CUDA graphs; on a CPU {CPU_CACHE_MEMORY_BYTES >> 20})")
    g.add_argument("--gpu-memory-utilization", type=float, metavar="F",
                   help="share of the GPU's total memory this engine may use in all, where --cache-memory-mb is not "
                        f"given ({d.gpu_memory_utilization}); processes sharing a GPU each take a share, e.g. 0.45 for "
                        "two")
    g.add_argument("--num-kv-blocks", type=int, help="KV blocks (overrides --cache-memory-mb)")
    g.add_argument("--max-model-len", type=int, help="longest prompt + output (the model's)")
    g.add_argument("--dtype", choices=SUPPORTED_DTYPES, help=f"({d.dtype})")
    g.add_argument("--device", help="cpu, cuda or cuda:N (default auto: CUDA where a GPU is visible, else the CPU)")
    g.add_argument("--kernels", choices=KERNEL_MODES,
                   help="the ops' implementation: Triton kernels on CUDA and torch references elsewhere (auto), the "
                        "references (torch, to rule a kernel out when debugging) or the kernels (triton) (auto)")
    g.add_argument("--ssm-state-dtype", choices=SUPPORTED_DTYPES[1:],
                   help="SSM state pool dtype (the checkpoint's mamba_ssm_cache_dtype)")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES,
                   help="attention KV pool storage: the model dtype (auto) or float8_e4m3fn with a K and a V scale "
                        "per layer, the checkpoint's k_scale / v_scale where it ships them, else one (fp8: twice the "
                        "blocks for the same memory, at some accuracy cost; the Triton kernels need an Ada or Hopper "
                        f"GPU or newer) ({d.kv_cache_dtype})")
    g.add_argument("--cuda-graphs", choices=("on", "off"),
                   help="replay decode steps as CUDA graphs on CUDA devices (on)")
    g.add_argument("--async-scheduling", choices=("on", "off"),
                   help="schedule step n+1 while step n runs on the device (with K drafts: greedy verify steps "
                        "chained on the one in flight) (on)")
    g.add_argument("--fused-gemv-max-tokens", type=int, metavar="N",
                   help="steps of at most N tokens run linear layers as Triton GEMVs with the norm / activation "
                        "before each fused in (0 = off; default: per GPU model where measured faster, else 0)")
    g.add_argument("--mixed-graph-tokens", type=int, metavar="Q",
                   help="steps with decode rows carry at most one prompt chunk of at most Q tokens and replay a "
                        "CUDA graph instead of running eagerly (0 = off; default 256 where decode steps replay "
                        "CUDA graphs and K = 0, else 0)")
    g.add_argument("--tensor-parallel-size", type=int, metavar="N",
                   help="tensor-parallel ranks, one process each, which the node starts (rank 0 serves; on CUDA "
                        "rank r computes on visible GPU r); prefill and decode nodes may differ in it (1)")
    g.add_argument("--no-prefix-cache", dest="enable_prefix_caching", action="store_const", const=False,
                   help="turn prefix caching off (on: KV blocks and recurrent-state checkpoints of earlier prompts are "
                        "kept while their memory is not needed, and a prompt that starts like an earlier one "
                        "prefills only the rest)")
    g.add_argument("--prefix-checkpoint-stride", type=int, metavar="N",
                   help="KV blocks between the prefix cache's state checkpoints of a prompt: 1 takes one at every "
                        f"block boundary, larger ones take and keep fewer ({d.prefix_checkpoint_stride})")
    g.add_argument("--speculative-tokens", dest="num_speculative_tokens", type=int, metavar="K",
                   help=f"MTP draft tokens per decode step, 0..{MAX_SPECULATIVE_TOKENS} (0 = off); needs a "
                        "checkpoint with MTP weights")
    g.add_argument("--max-logprobs", type=int, metavar="K",
                   help=f"most top alternatives a request's logprobs / prompt_logprobs may ask for (more are "
                        f"refused) ({d.max_logprobs})")


ENGINE_FLAGS = ("block_size", "max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold",
                "cache_memory_mb", "gpu_memory_utilization", "num_kv_blocks", "max_model_len", "dtype", "device",
                "kernels", "num_speculative_tokens",
                "ssm_state_dtype", "kv_cache_dtype", "cuda_graphs", "async_scheduling", "fused_gemv_max_tokens",
                "mixed_graph_tokens",
                "tensor_parallel_size", "prefix_checkpoint_stride", "enable_prefix_caching", "max_logprobs")
# Flags whose option is not the dest name with dashes.
_OPTIONS = {"num_speculative_tokens": "--speculative-tokens"}
# Flags without a value: the option given sets its dest to this.
_SWITCHES = {"enable_prefix_caching": ("--no-prefix-cache", False)}


def engine_flags(a: argparse.Namespace) -> list[str]:
    """The engine flags given on this command line, to pass on to node processes. Raises ValueError for
    values the engine would refuse, so that a bad flag ends the command before any process starts."""
    engine_config_from_args(a)
    out: list[str] = []
    for name in ENGINE_FLAGS:
        v = getattr(a, name)
        if name in _SWITCHES:
            option, value = _SWITCHES[name]
            out += [option] if v == value else []
        elif v is not None:
            out += [_OPTIONS.get(name, "--" + name.replace("_", "-")), str(v)]
    return out


def parse_engine_flags(flags: Sequence[str], option: str,
                       max_num_batched_tokens: int | None = None) -> argparse.Namespace:
    """Engine flags from a list (e.g. a role's `--prefill-engine-args` split into words). Raises ValueError naming
    `option` for anything else; values are checked by `engine_config_from_args`. `max_num_batched_tokens`: the
    step budget when the flags leave it out (None: the engine's)."""
    p = argparse.ArgumentParser(prog=option, add_help=False, exit_on_error=False)
    add_engine_args(p, max_num_batched_tokens)
    try:
        a, unknown = p.parse_known_args(list(flags))
    except argparse.ArgumentError as e:
        raise ValueError(f"{option}: expected engine flags, got {' '.join(flags)!r}: {e}") from None
    if unknown:
        raise ValueError(f"{option}: expected engine flags only, got unknown {' '.join(unknown)!r}")
    return a


def role_engine_flags(text: str, option: str, common: Sequence[str] = (),
                      max_num_batched_tokens: int | None = None) -> tuple[str, ...]:
    """One role's extra engine flags (`baton up --prefill-engine-args "--max-num-batched-tokens 4096"`), split into
    words and checked on top of the flags every node gets (`common`; a later flag wins, as on the node's command
    line), with the role's step budget where neither gives one (`max_num_batched_tokens`, None: the engine's):
    unknown flags and values the engine would refuse raise ValueError before any process starts."""
    try:
        flags = tuple(shlex.split(text))
    except ValueError as e:  # an unclosed quote
        raise ValueError(f"{option}: expected shell words, got {text!r}: {e}") from None
    engine_config_from_args(parse_engine_flags((*common, *flags), option, max_num_batched_tokens))
    return flags


def flags_ranks(flags: Sequence[str]) -> int:
    """The tensor-parallel ranks a node command line asks for: its last --tensor-parallel-size (either spelling),
    else 1 (the flags were checked already, `role_engine_flags`)."""
    tp = 1
    for i, arg in enumerate(flags):
        if arg == "--tensor-parallel-size" and i + 1 < len(flags):
            tp = int(flags[i + 1])
        elif arg.startswith("--tensor-parallel-size="):
            tp = int(arg.split("=", 1)[1])
    return tp


def engine_config_from_args(a: argparse.Namespace) -> EngineConfig:
    """Flags left out keep `EngineConfig`'s defaults."""
    given = {name: getattr(a, name) for name in ENGINE_FLAGS if getattr(a, name) is not None}
    if "cache_memory_mb" in given:
        given["cache_memory_bytes"] = given.pop("cache_memory_mb") * 2**20
    for name in ("cuda_graphs", "async_scheduling"):
        if name in given:
            given[name] = given[name] == "on"
    return EngineConfig(**given)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--seed", type=int, default=None, help="per-request seed (each prompt gets this seed)")
    g.add_argument("--stop-token-ids", type=parse_ids, default=(), help='e.g. "5 7"')
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--min-p", type=float, default=0.0, help="keep tokens with p >= min_p * p_max; 0 = off")
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off")
    g.add_argument("--logit-bias", type=parse_bias, default={}, help='token id:bias pairs, e.g. "5:-100 7:2.5"')
    g.add_argument("--min-tokens", type=int, default=0, help="EOS and stop token ids are masked until this many")


def sampling_options(a: argparse.Namespace) -> dict[str, Any]:
    """The sampling flags as keyword arguments of SamplingParams (and of the client's generate)."""
    return dict(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, seed=a.seed,
                stop_token_ids=tuple(a.stop_token_ids), ignore_eos=a.ignore_eos, min_p=a.min_p,
                presence_penalty=a.presence_penalty, frequency_penalty=a.frequency_penalty,
                repetition_penalty=a.repetition_penalty, logit_bias=dict(a.logit_bias), min_tokens=a.min_tokens)


def sampling_from_args(a: argparse.Namespace) -> SamplingParams:
    return SamplingParams(**sampling_options(a))


def parse_bias(text: str) -> dict[int, float]:
    try:
        pairs = [t.split(":") for t in text.replace(",", " ").split()]
        return {int(k): float(v) for k, v in pairs}
    except ValueError:
        raise argparse.ArgumentTypeError(f'expected token id:bias pairs such as "5:-100 7:2.5", got {text!r}') from None


def parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected space-separated token ids, got {text!r}") from None
