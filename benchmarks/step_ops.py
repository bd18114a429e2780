"""Host work of one eager engine step on the GPU code path, counted on a CPU: ATen ops and Triton launches.

An eager step's wall time on a GPU is bound by the host when its kernels are short: each ATen op costs the
host several microseconds (dispatch, allocator, launch), each Triton launch more (argument binding,
specialisation key). A captured decode step replays the same kernels, each a few microseconds of GPU time
at batch 1, where they add up next to the weights' read. This benchmark counts them for one step, on the
path the GPU takes (`EngineConfig.kernels="triton"`), without running any kernel: Triton launches are counted and
skipped (`TRITON_INTERPRET=1` with the interpreter's launch replaced), ATen ops are counted by a dispatch
mode, split by the layer kind whose mixer issued them (Mamba2 `M`, attention `*`, MLP `-`) and the rest
of the step: embeddings, the residual adds and pre-norms between mixers, batch building, sampling.

Steps: `prefill` (a prefill-only engine, as a prefill node runs: `--rows` prompts of `--tokens` tokens in
all, one step) or `decode` (`--rows` requests, one decode step once all are prefilled). Models: the layer
patterns of serving_bench's `1b-hybrid` (27 layers) or `8b-like` (52 layers), at toy widths: the counts
depend on the pattern and the batch's rows, not on the widths.

Ops are grouped as `views` (metadata only: view, reshape of a viewable tensor, slice, split, a same-dtype
`to`, ...), `allocs` (empty tensors: the caching allocator, no kernel) and `kernels` (everything else: an
ATen kernel launch on a GPU, or a host-device copy; on a CPU also the reference's host-side checks, which a
GPU skips). The numbers are exact counts, the same on every machine.

  python benchmarks/step_ops.py                              # 1b-hybrid prefill: 2 rows, 2048 tokens
  python benchmarks/step_ops.py --step decode --rows 1 --model 8b-like
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels become interpreter objects

import argparse  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from baton.engine.engine_config import EngineConfig  # noqa: E402
from baton.engine.llm_engine import LLMEngine  # noqa: E402
from baton.engine.loader import load_checkpoint  # noqa: E402
from baton.engine.make_model import build_config, make_model  # noqa: E402
from baton.engine.model import Block  # noqa: E402
from baton.engine.ops.kernels import bind_kernels, resolve_kernels  # noqa: E402
from baton.engine.sampling_params import SamplingParams  # noqa: E402

PATTERNS = {
    "1b-hybrid": "M-M-M*-M-M-M-M*-M-M-M*-M-M-",  # serving_bench's
    "8b-like": build_config("8b-like")["hybrid_override_pattern"],
}
TOY = {"vocab_size": 512, "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
       "intermediate_size": 128, "mamba_num_heads": 4, "mamba_head_dim": 32, "ssm_state_size": 16, "n_groups": 2,
       "chunk_size": 128, "max_position_embeddings": 16384}
VIEWS = frozenset({
    "aten.view", "aten._unsafe_view", "aten.reshape", "aten.slice", "aten.select", "aten.split",
    "aten.split_with_sizes", "aten.squeeze", "aten.unsqueeze", "aten.detach", "aten.detach_", "aten.alias",
    "aten.t", "aten.transpose", "aten.permute", "aten.expand", "aten.as_strided", "aten.unbind", "aten.narrow",
    "aten.view_as", "aten.lift_fresh", "aten.promote_types", "aten.result_type", "aten.is_same_size",
    "aten.to",  # itself a no-op; a conversion shows up as aten._to_copy
})
ALLOCS = frozenset({"aten.empty", "aten.empty_like", "aten.new_empty", "aten.empty_strided", "aten.new_empty_strided"})
KINDS = {"M": "mamba2", "*": "attention", "-": "mlp"}
GROUPS = ("kernels", "allocs", "views", "triton")


class Census(TorchDispatchMode):
    """Counts ATen ops by (layer kind, group); `kind` is set by the layers' hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.kind = "rest"
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self.names: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        group = "views" if name in VIEWS else "allocs" if name in ALLOCS else "kernels"
        self.counts[(self.kind, group)] += 1
        if group == "kernels":
            self.names[f"{self.kind}: {name}"] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def counting(engine: LLMEngine):
    """Counts ATen ops and Triton launches inside the block; Triton kernels do not run."""
    import triton.runtime.interpreter as interpreter

    census = Census()
    run = interpreter.InterpretedFunction.run

    def launch(self, *args, **kwargs):  # counted, not run
        census.counts[(census.kind, "triton")] += 1
        census.names[f"{census.kind}: triton {self.fn.__name__}"] += 1

    def enter(kind: str):
        def hook(module, inputs):
            census.kind = kind
        return hook

    def leave(module, inputs, output):
        census.kind = "rest"

    def pending(kind: str, fn):  # forward_pending (fused GEMV steps) is a plain call: no module hooks
        def wrapped(*args, **kwargs):
            census.kind = kind
            try:
                return fn(*args, **kwargs)
            finally:
                census.kind = "rest"
        return wrapped

    handles = []
    patched = []
    for block in engine.runner.model.model.layers:
        assert isinstance(block, Block)
        mixer = block.mixer
        handles += [mixer.register_forward_pre_hook(enter(KINDS[block.kind])), mixer.register_forward_hook(leave)]
        if hasattr(mixer, "forward_pending"):
            mixer.forward_pending = pending(KINDS[block.kind], mixer.forward_pending)
            patched.append(mixer)
    interpreter.InterpretedFunction.run = launch
    try:
        with census:
            yield census
    finally:
        interpreter.InterpretedFunction.run = run
        for h in handles:
            h.remove()
        for mixer in patched:
            del mixer.forward_pending  # the instance attribute: the method shows through again


def _bind(engine: LLMEngine, mode: str) -> None:
    """Rebind the engine's layers to `mode`'s ops: only this benchmark switches after start, to reach the counted
    step sooner."""
    kernels = resolve_kernels(mode, "cpu")
    for module in (engine.model, engine.mtp):
        if module is not None:
            bind_kernels(module, kernels)


def engine_for(pattern: str, step: str, rows: int, tokens: int, spec: int = 0, fused_gemv: int = 0) -> LLMEngine:
    """A toy-width engine of `pattern` on the CPU (with an MTP drafter of `spec` tokens), holding the requests
    whose next step is the one counted."""
    with tempfile.TemporaryDirectory() as tmp:
        make_model(tmp, "8b-like", overrides={**TOY, "hybrid_override_pattern": pattern}, progress=False,
                   tokenizer=False, mtp_layers=1 if spec else 0)
        cfg, weights = load_checkpoint(Path(tmp))
    prefill = step == "prefill"
    engine = LLMEngine(cfg, weights, EngineConfig(
        device="cpu", dtype="bfloat16", max_num_seqs=rows, max_num_batched_tokens=max(tokens, rows * (1 + spec)),
        num_kv_blocks=tokens // 16 + 2 * rows + 2, block_size=16, max_model_len=tokens + 8 * (1 + spec),
        prefill_only=prefill, num_speculative_tokens=spec, fused_gemv_max_tokens=fused_gemv, kernels="triton",
        enable_prefix_caching=False))  # (one step's ops, not cache hits)
    engine.depth = 0  # one step at a time: each step() call below is one whole step
    # Prefill: R1 keeps one token back, so prompts of n + 1 tokens prefill n. Decode: short prompts.
    lens = [tokens // rows + (i < tokens % rows) + 1 for i in range(rows)]
    for i, n in enumerate(lens):
        engine.add_request([(7 * i + j) % 500 + 3 for j in range(n)],
                           SamplingParams(max_tokens=1 if prefill else 8, ignore_eos=True), prefill_only=prefill)
    if not prefill:  # the prompts' steps on the torch references (interpreted kernels would take ~10x as long)
        _bind(engine, "torch")
        try:
            while engine.scheduler.waiting or any(not r.in_decode for r in engine.scheduler.running):
                engine.step()
        finally:
            _bind(engine, "triton")
    return engine


def bench(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--step", choices=("prefill", "decode"), default="prefill")
    ap.add_argument("--model", choices=tuple(PATTERNS), default="1b-hybrid", help="layer pattern (default 1b-hybrid)")
    ap.add_argument("--rows", type=int, default=2, help="requests in the step (default: 2)")
    ap.add_argument("--tokens", type=int, default=2048,
                    help="prefill: prompt tokens in the step, split evenly (default 2048); decode: prompt tokens")
    ap.add_argument("--spec", type=int, default=0,
                    help="decode: speculative tokens K (an MTP drafter; the step is a verify step), default 0")
    ap.add_argument("--fused-gemv-max-tokens", type=int, default=0,
                    help="the engine's fused_gemv_max_tokens (linear layers with their norm / activation fused in)")
    ap.add_argument("--top", type=int, default=12, help="most frequent kernel ops to list (default: 12)")
    ap.add_argument("--json", type=Path, default=None, help="also write the counts here")
    a = ap.parse_args(argv)
    if a.rows < 1 or a.tokens < a.rows:
        raise ValueError(f"--rows / --tokens: expected 1 <= rows <= tokens, got {a.rows} / {a.tokens}")
    if a.spec < 0 or (a.spec and a.step != "decode"):
        raise ValueError(f"--spec: expected 0, or K > 0 with --step decode, got {a.spec} with --step {a.step}")
    pattern = PATTERNS[a.model]
    engine = engine_for(pattern, a.step, a.rows, a.tokens, a.spec, a.fused_gemv_max_tokens)
    prompt0, decode0 = engine.stats.prompt_tokens, engine.stats.decode_tokens
    with counting(engine) as census:
        engine.step()
    done = (engine.stats.prompt_tokens - prompt0, engine.stats.decode_tokens - decode0)
    want = (a.tokens, 0) if a.step == "prefill" else (0, a.rows * (1 + a.spec))
    if done != want:
        raise RuntimeError(f"expected one {a.step} step of {want} (prompt, decode) tokens, got {done}")
    layers = collections.Counter(KINDS[c] for c in pattern)
    table = {kind: {g: census.counts[(kind, g)] for g in GROUPS} for kind in (*KINDS.values(), "rest")}
    total = {g: sum(row[g] for row in table.values()) for g in GROUPS}
    what = f"{a.tokens} tokens in {a.rows} rows" if a.step == "prefill" else f"{a.rows} rows, K = {a.spec}"
    print(f"step_ops: one {a.step} step of {what}, {a.model} layers {pattern} "
          f"({layers['mamba2']} M, {layers['attention']} *, {layers['mlp']} -)")
    print(f"{'':>12} {'kernels':>8} {'allocs':>8} {'views':>8} {'triton':>8}   per layer: kernels+triton")
    for kind, row in table.items():
        per = f"{(row['kernels'] + row['triton']) / layers[kind]:.1f}" if kind in layers else ""
        print(f"{kind:>12} {row['kernels']:8d} {row['allocs']:8d} {row['views']:8d} {row['triton']:8d}   {per}")
    print(f"{'step':>12} {total['kernels']:8d} {total['allocs']:8d} {total['views']:8d} {total['triton']:8d}")
    print(f"most frequent kernel ops and launches (of {total['kernels'] + total['triton']}):")
    for name, n in census.names.most_common(a.top):
        print(f"  {n:5d}  {name}")
    result = {"step": a.step, "model": a.model, "rows": a.rows, "tokens": a.tokens, "spec": a.spec, "pattern": pattern,
              "fused_gemv_max_tokens": a.fused_gemv_max_tokens,
              "by_kind": table, "total": total}
    if a.json is not None:
        a.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    bench(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
