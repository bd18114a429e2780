"""Which Triton kernel specializations a multi-turn chat workload meets after the engine's warm-up (issue #51).

On a GPU, each kernel specialization a process meets for the first time is a compile (or a load from Triton's disk
cache) inside the step that meets it: after the warm-up (`engine/warm_up.py`), inside some request's time to first
token. This builds one engine of a preset (random weights, in memory), runs its warm-up, then the multi-turn chat
workload of `multiturn_bench.py` (a system prompt shared by all, each turn carrying the turns before it) in this
process, closed loop, as a prefill node runs it (`--role prefill`: N-1 tokens, the caches held, then freed) or as
an aggregated node (`--role agg`: the answers generated). It reports every specialization first met in the
workload: the kernel, the arguments in which it differs from the nearest one met before, and the step that met it.

How a specialization is seen:
- on a GPU (`--device cuda`), through Triton's `jit_cache_hook`, which Triton calls on every specialization new to
  the process: exactly what compiles;
- on the CPU, the kernels run in Triton's interpreter (`TRITON_INTERPRET=1`, set here), which compiles nothing:
  each launch's specialization is computed by Triton's own binder (`create_function_from_signature`), by the
  compiler's rules (an integer equal to 1 or divisible by 16, a pointer 16-byte aligned, constexpr values).
  Launch choices a kernel's host side makes from the device (tiles, split-K) are the interpreter's there, so a
  GPU meets other variants of those kernels.

    python benchmarks/kernel_variants.py                       # CPU: tiny preset, prefill role, interpreter
    python benchmarks/kernel_variants.py --role agg --preset qwen3.5-tiny
    python benchmarks/kernel_variants.py --device cuda --preset 8b-like --system-tokens 2048 --turns 8 \\
        --answer-min 100 --answer-max 300 --concurrency 32 --engine-args "--max-num-batched-tokens 8192"

Exit status 0 whatever it finds (a report, not a check); `tests/test_kernel_variants.py` is the check.
"""

from __future__ import annotations

import argparse
import os
import sys

if __name__ == "__main__":
    # Before anything imports triton: off the GPU the kernels run in Triton's interpreter.
    _pre = argparse.ArgumentParser(add_help=False)
    _pre.add_argument("--device", default="cpu")
    if _pre.parse_known_args()[0].device != "cuda":
        os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses  # noqa: E402
import json  # noqa: E402
import shlex  # noqa: E402
import time  # noqa: E402
from collections import deque  # noqa: E402
from collections.abc import Callable, Iterator, Sequence  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from baton.engine.compile_watch import (  # noqa: E402
    KernelVariant,
    launch_options,
    spec_text,
    variant_of_hook_call,
)
from baton.engine.config import ModelConfig  # noqa: E402
from baton.engine.llm_engine import LLMEngine  # noqa: E402
from baton.engine.make_model import PRESET_NAMES, build_config  # noqa: E402
from baton.engine.sampling_params import SamplingParams  # noqa: E402
from baton.engine.weights import TORCH_DTYPES  # noqa: E402
from baton.node.engine_args import add_engine_args, engine_config_from_args  # noqa: E402
from benchmarks.engine_bench import random_weights  # noqa: E402
from benchmarks.multiturn_bench import Workload  # noqa: E402
from benchmarks.run_info import device_name, git_commit  # noqa: E402

ROLES = ("prefill", "agg")
PHASES = ("start-up", "warm-up", "workload")


@dataclass(frozen=True)
class Met:
    variant: KernelVariant
    phase: str
    step: int  # the engine's step count in that phase when first met

    def to_json(self) -> dict[str, object]:
        return {"kernel": self.variant.kernel, "phase": self.phase, "step": self.step,
                "params": dict(self.variant.params), "options": self.variant.options}


@dataclass
class Census:
    """Every kernel specialization met, in order, with the phase (and step) that first met it."""
    phase: str = PHASES[0]
    step: int = 0
    met: dict[KernelVariant, Met] = field(default_factory=dict)

    def record(self, variant: KernelVariant) -> None:
        if variant not in self.met:
            self.met[variant] = Met(variant, self.phase, self.step)

    def first_met_in(self, phase: str) -> list[Met]:
        return [m for m in self.met.values() if m.phase == phase]

    def nearest_before(self, m: Met) -> KernelVariant | None:
        """The variant of the same kernel, met in an earlier phase, that differs from `m`'s in the fewest places."""
        order = PHASES.index(m.phase)
        return m.variant.nearest([v for v, e in self.met.items() if PHASES.index(e.phase) < order])


def _interpreter_binder(fn) -> Callable:
    """Triton's own argument binder for an interpreted kernel, as `JITFunction` builds it for a compiled one."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    jit = JITFunction(fn.fn, **fn.kwargs)
    return create_function_from_signature(jit.signature, jit.params, BaseBackend)


@contextmanager
def watching(census: Census) -> Iterator[None]:
    """Record into `census` every kernel specialization launched inside the block: through Triton's interpreter
    where it is on, else through `jit_cache_hook` (a specialization new to this process), chained to the hook
    already set (the engine's warm-up sets one that logs)."""
    import triton

    if os.environ.get("TRITON_INTERPRET") == "1":
        from triton.runtime.interpreter import InterpretedFunction

        run, binders = InterpretedFunction.run, {}

        def counted(self, *args, grid, warmup, **kwargs):
            if self not in binders:
                binders[self] = _interpreter_binder(self)
            bound, specs, options = binders[self](*args, **kwargs)
            census.record(KernelVariant(self.fn.__qualname__,
                                        tuple((n, spec_text(s)) for n, s in zip(bound, specs, strict=False)),
                                        launch_options(options.get("num_warps"), options.get("num_stages"))))
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)

        InterpretedFunction.run = counted
        try:
            yield
        finally:
            InterpretedFunction.run = run
        return

    runtime = triton.knobs.runtime
    kept = runtime.jit_cache_hook

    def hook(**kw) -> bool:
        census.record(variant_of_hook_call(kw))
        return bool(kept(**kw)) if kept is not None else False

    runtime.jit_cache_hook = hook
    try:
        yield
    finally:
        runtime.jit_cache_hook = kept


@dataclass(frozen=True)
class WorkloadRun:
    turns: int
    steps: int
    prompt_tokens: int
    hit_tokens: int
    seconds: float


def run_workload(engine: LLMEngine, w: Workload, role: str, census: Census, progress: bool = False) -> WorkloadRun:
    """`w`'s conversations through `engine`, closed loop (`w.concurrency` at once, each turn sent when the one
    before it has its answer). A prefill node's turn computes its prompt's first N-1 tokens and hands its caches
    over (freed here as a decode node's read would); its answer is then `w.answer_tokens` ids as the decode node
    would stream. An aggregated node generates the answer. Kernels do not depend on the ids' values."""
    if role not in ROLES:
        raise ValueError(f"role: expected one of {ROLES}, got {role!r}")
    prefill = role == "prefill"
    if prefill != engine.config.prefill_only:
        raise ValueError(f"role {role!r}: expected an engine with prefill_only={prefill}, got "
                         f"{engine.config.prefill_only}")
    system = w.system_prompt()
    history: dict[int, list[int]] = {c: [] for c in range(w.conversations)}
    turn = dict.fromkeys(range(w.conversations), 0)
    waiting, active = deque(range(w.conversations)), {}
    steps0, t0 = engine.stats.steps, time.perf_counter()
    prompt_tokens = hits = done = 0
    bar = tqdm(total=w.conversations * w.turns, desc=f"workload ({role})", unit="turn", disable=not progress)
    while waiting or active:
        while waiting and len(active) < w.concurrency:
            c = waiting.popleft()
            user = w.user_message(c, turn[c])
            prompt = system + history[c] + user
            answer = w.answer_tokens(c, turn[c])
            rid = f"c{c}-t{turn[c]}"
            params = SamplingParams(max_tokens=1 if prefill else answer, ignore_eos=True)
            engine.add_request(prompt, params, request_id=rid, prefill_only=prefill)
            active[rid] = (c, user, answer)
            prompt_tokens += len(prompt)
        census.step = engine.stats.steps - steps0
        for out in engine.step():
            if out.held_state_slot is not None:
                engine.free_held(out.held_block_ids, out.held_state_slot)
            if not out.finished:
                continue
            c, user, answer = active.pop(out.request_id)
            ids = list(out.token_ids) if not prefill else [(7 * c + 3 * i) % w.vocab_size for i in range(answer)]
            history[c] += user + ids
            turn[c] += 1
            done += 1
            bar.update()
            if turn[c] < w.turns:
                waiting.append(c)
    bar.close()
    if engine.scheduler.prefix is not None:
        hits = engine.scheduler.prefix.hit_tokens
    return WorkloadRun(done, engine.stats.steps - steps0, prompt_tokens, hits, time.perf_counter() - t0)


def build_engine(preset: str, role: str, engine_args: Sequence[str], seed: int, progress: bool) -> LLMEngine:
    """An engine of `preset` with random weights, configured by a node's engine flags (`engine_args`); a prefill
    role's engine only prefills, as a prefill node's does."""
    p = argparse.ArgumentParser(prog="--engine-args", add_help=False)
    add_engine_args(p)
    config = engine_config_from_args(p.parse_args(list(engine_args)))
    if role == "prefill":
        config = dataclasses.replace(config, prefill_only=True)
    hf = build_config(preset)
    cfg = ModelConfig.from_hf_dict(hf)
    dtype = TORCH_DTYPES[config.dtype if config.dtype != "auto" else cfg.torch_dtype]
    device = torch.device(config.device if config.device != "auto" else
                          ("cuda" if torch.cuda.is_available() else "cpu"))
    weights = random_weights(cfg, hf, device, dtype, seed, progress)
    return LLMEngine(cfg, weights, config)


@dataclass(frozen=True)
class Report:
    role: str
    preset: str
    device: str
    warm_up: str
    workload: WorkloadRun
    counts: dict[str, int]  # variants first met per phase
    after: list[dict[str, object]]  # those first met in the workload, each with its differences

    def markdown(self) -> str:
        w = self.workload
        lines = [f"kernel variants, {self.preset}, {self.role} role, on {self.device}: "
                 + ", ".join(f"{n} {p}" for p, n in self.counts.items()),
                 f"{self.warm_up}; workload: {w.turns} turns in {w.steps} steps, {w.prompt_tokens} prompt tokens "
                 f"({w.hit_tokens} from the prefix cache), {w.seconds:.1f} s", ""]
        if not self.after:
            lines.append("no kernel specialization first met after the warm-up")
            return "\n".join(lines)
        lines += ["| kernel | workload step | differs from the nearest met before in |", "| --- | ---: | --- |"]
        for a in self.after:
            lines.append(f"| `{a['kernel']}` | {a['step']} | {'; '.join(a['differs']) or '–'} |")
        return "\n".join(lines)


def census_run(engine: LLMEngine, w: Workload, role: str, warm_up: bool = True, progress: bool = False) -> Report:
    """Warm `engine` up (unless `warm_up` is False), then run `w` on it, and report what each phase met. Kernels
    already met in this process before the call count as met at start-up on the CPU; on a GPU Triton's in-process
    cache keeps them, so they are not seen again."""
    census = Census()
    with watching(census):
        census.phase = "warm-up"
        ran = engine.warm_up(everywhere=True) if warm_up else None
        census.phase, census.step = "workload", 0
        done = run_workload(engine, w, role, census, progress)
    after = []
    for m in census.first_met_in("workload"):
        near = census.nearest_before(m)
        after.append({**m.to_json(), "differs": m.variant.differences(near) if near else
                      ["kernel not met before the workload"]})
    counts = {p: len(census.first_met_in(p)) for p in PHASES}
    return Report(role, "", engine.config.device, ran.summary() if ran else "no warm-up", done, counts, after)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny", choices=PRESET_NAMES)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--role", default="prefill", choices=ROLES)
    p.add_argument("--engine-args", default="--block-size 16 --max-num-seqs 16 --max-num-batched-tokens 64 "
                   "--max-model-len 1024 --prefix-checkpoint-stride 2",
                   help="the node's engine flags (quoted); --device follows --device, and on the CPU --kernels triton "
                        "comes first")
    p.add_argument("--no-warm-up", action="store_true", help="run the workload on a cold engine (what it meets)")
    p.add_argument("--conversations", type=int, default=3)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-tokens", type=int, default=40)
    p.add_argument("--user-tokens", type=int, default=9)
    p.add_argument("--answer-min", type=int, default=3)
    p.add_argument("--answer-max", type=int, default=11)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write kernel_variants_<preset>_<role>.json there")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: expected a visible GPU, got none")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    # On the CPU the Triton kernels (in the interpreter), not the torch references that the CPU defaults to.
    kernels = ["--kernels", "triton"] if a.device == "cpu" else []
    engine = build_engine(a.preset, a.role, [*kernels, *shlex.split(a.engine_args), "--device", a.device], a.seed,
                          True)
    w = Workload(a.conversations, a.turns, a.system_tokens, a.user_tokens, a.answer_min, a.answer_max,
                 a.concurrency, engine.model_config.vocab_size, a.seed)
    report = dataclasses.replace(census_run(engine, w, a.role, not a.no_warm_up, progress=True), preset=a.preset,
                                 device=device_name(torch.device(a.device)))
    print(report.markdown())
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        path = a.out / f"kernel_variants_{a.preset}_{a.role}.json"
        path.write_text(json.dumps({"commit": git_commit(), "args": vars(a) | {"out": str(a.out)},
                                    **dataclasses.asdict(report)}, indent=1))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
