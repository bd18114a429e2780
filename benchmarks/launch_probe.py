"""Which launch settings a decode step should take, decided by timing whole steps rather than kernels alone.

A kernel timed alone misleads: tiles that won alone have lost in the step, and settings that tied alone have won
in it (RESULTS.md, the decode step history: one warp per state-update program, attention key tiles of 128). This
probe builds one engine over engine_bench's in-memory model, puts B requests in decode, and for each variant
patches the ops' launch settings, recaptures the batch's CUDA graph (on a GPU; a CPU engine runs its steps
eagerly) and times `--steps` steady-state steps (engine_bench's `pipelined_step_times`). Variants alternate
over `--rounds`; contexts grow as steps run, so each time is divided by the traffic roofline at its own
context (engine_bench's `decode_traffic` over the copy bandwidth measured at the start), and a variant is
compared with `base` (the tree's own settings) as the mean of those ratios.

A variant is `base` or settings joined by `+`, each `op.knob=value`:

    ssu.warps, ssu.block_p            decode state update: warps per program, head-dim rows per program
    attn.block_n, attn.warps          decode attention (one query per row): key tile, warps
    attn.stages                       decode attention's software-pipeline stages
    conv.block_c, conv.warps          conv update: channels per program, warps
    gemv.wide, gemv.narrow, gemv.longk  the 2-64-row tensor-core GEMV's tile BNxBKxWARPSxSTAGES[xSPLIT]
                                      (its block of rows kept) for layers with N > 8192 / N <= 8192 and
                                      K <= 4096 / K > 4096

  python benchmarks/launch_probe.py --batches 256 --variants base,ssu.warps=2,attn.block_n=64 --rounds 2
  python benchmarks/launch_probe.py --smoke    # CPU, tiny preset: the plumbing only (no Triton, no graphs)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import statistics
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from baton.engine.config import ModelConfig  # noqa: E402
from baton.engine.llm_engine import LLMEngine  # noqa: E402
from benchmarks import engine_bench as eb  # noqa: E402
from benchmarks.run_info import device_name, git_commit  # noqa: E402

KNOBS = {
    "ssu": ("warps", "block_p"),
    "attn": ("block_n", "warps", "stages"),
    "conv": ("block_c", "warps"),
    "gemv": ("wide", "narrow", "longk"),
}


@dataclass(frozen=True)
class Setting:
    op: str
    knob: str
    value: tuple[int, ...]  # one int, or a GEMV tile's 4-5


def parse_variant(text: str) -> tuple[Setting, ...]:
    """'base' -> (); 'ssu.warps=1+attn.block_n=128' -> its settings. ValueError naming what was expected."""
    text = text.strip()
    if text == "base":
        return ()
    out = []
    for part in text.split("+"):
        key, eq, value = part.partition("=")
        op, dot, knob = key.strip().partition(".")
        if not (eq and dot):
            raise ValueError(f"variant {text!r}: expected 'base' or op.knob=value joined by '+', "
                             f"got {part!r}")
        if op not in KNOBS or knob not in KNOBS[op]:
            names = ", ".join(f"{o}.{k}" for o, ks in KNOBS.items() for k in ks)
            raise ValueError(f"variant {text!r}: expected one of {names}, got {key.strip()!r}")
        try:
            ints = tuple(int(v) for v in value.strip().split("x"))
        except ValueError:
            ints = ()
        want = (4, 5) if op == "gemv" else (1,)
        if len(ints) not in want or any(v < 1 for v in ints):
            shape = "BNxBKxWARPSxSTAGES[xSPLIT]" if op == "gemv" else "a positive integer"
            raise ValueError(f"variant {text!r}: {op}.{knob} expected {shape}, got {value.strip()!r}")
        out.append(Setting(op, knob, ints))
    return tuple(out)


def _gemv_class(n: int, k: int) -> str:
    return "wide" if n > 8192 else "longk" if k > 4096 else "narrow"


@contextlib.contextmanager
def patched(settings: tuple[Setting, ...]) -> Iterator[None]:
    """The ops' launch settings overridden inside the block (new launches and captures only), restored
    after."""
    import baton.engine.ops.attention.kernel as ta
    import baton.engine.ops.conv.kernel as tc
    import baton.engine.ops.linear.kernel as tg
    import baton.engine.ops.ssm_update.kernel as ts

    want = {(s.op, s.knob): s.value for s in settings}
    saved = [(ts, "_launch_config"), (ta, "_launch_config"), (ta, "DECODE_STAGES"), (tc, "_default_block_c"),
             (tc, "_num_warps"), (tg, "default_tiles")]
    originals = [(mod, name, getattr(mod, name)) for mod, name in saved]
    ssu_lc, attn_lc, tiles = ts._launch_config, ta._launch_config, tg.default_tiles

    def ssu(P: int, N: int, verify: bool = False, batch: int = 0) -> tuple[int, int, int]:
        bp, bn, nw = ssu_lc(P, N, verify, batch)
        if not verify:
            bp = want.get(("ssu", "block_p"), (bp,))[0]
            nw = want.get(("ssu", "warps"), (nw,))[0]
        return bp, bn, nw

    def attn(group: int, head_dim: int, max_query_len: int | None, T: int, R: int) -> tuple[int, ...]:
        bq, bm, bn, bd, nw = attn_lc(group, head_dim, max_query_len, T, R)
        if bq == 1:
            bn = want.get(("attn", "block_n"), (bn,))[0]
            nw = want.get(("attn", "warps"), (nw,))[0]
        return bq, bm, bn, bd, nw

    def gemv(m: int, n: int, k: int, on_cuda: bool, itemsize: int = 2) -> object:
        t = tiles(m, n, k, on_cuda, itemsize)
        tile = want.get(("gemv", _gemv_class(n, k)))
        if tile is None or not on_cuda or not 2 <= m <= 64:
            return t
        bn, bk, nw, st, *split = tile
        return dataclasses.replace(t, block_n=bn, block_k=bk, num_warps=nw, num_stages=st, cublas=False,
                                   split_k=split[0] if split else t.split_k)

    try:
        ts._launch_config, ta._launch_config, tg.default_tiles = ssu, attn, gemv
        if ("attn", "stages") in want:
            ta.DECODE_STAGES = want[("attn", "stages")][0]
        if ("conv", "block_c") in want:
            tc._default_block_c = lambda batch, channels: want[("conv", "block_c")][0]
        if ("conv", "warps") in want:
            tc._num_warps = lambda block_c: want[("conv", "warps")][0]
        yield
    finally:
        for mod, name, value in originals:
            setattr(mod, name, value)


@dataclass(frozen=True)
class Point:
    variant: str
    batch: int
    round: int
    step_ms: float
    mean_context: float
    roofline_ms: float

    @property
    def ratio(self) -> float:
        return self.step_ms / self.roofline_ms


class Probe:
    """One engine in decode at one batch size; `measure(variant)` recaptures its graph under the variant."""

    def __init__(self, engine: LLMEngine, batch: int, context: int, max_tokens: int, copy_gbps: float,
                 seed: int) -> None:
        self.engine, self.batch, self.copy = engine, batch, copy_gbps
        self.device = torch.device(engine.config.device)
        self.ids = eb.enter_decode(engine, batch, context, max_tokens=max_tokens, seed=seed,
                                   device=self.device, progress=False)
        graphs = engine.runner.graphs
        self.graphs = graphs if graphs is not None and graphs.capture else None
        self.size = graphs.size_for(batch) if self.graphs is not None else None
        # Replaced graphs stay alive: freeing one captured into a pool other graphs share trips the caching
        # allocator (torch 2.11) on the next capture.
        self.replaced: list = []

    def _recapture(self) -> None:
        """The batch's decode graph captured afresh under the launch settings in force (none on a CPU
        engine)."""
        from baton.engine.cuda_graphs import capture_graph

        with eb.one_step_at_a_time(self.engine):
            self.engine.step()  # reads the step in flight: nothing of the old graph is queued after this
        if self.graphs is None or self.size is None:
            return
        g, n = self.graphs, self.size
        with torch.inference_mode():
            self.replaced.append(g.graphs.pop(n))
            g._pad(n)
            g.graphs[n] = capture_graph(lambda: g._forward(n), self.device, torch.cuda.graph_pool_handle())

    def measure(self, name: str, settings: tuple[Setting, ...], rnd: int, steps: int) -> Point:
        # Patched through the timed steps too: an engine without graphs launches them with the variant's
        # settings.
        with patched(settings):
            self._recapture()
            for _ in range(2):
                self.engine.step()
            contexts: list[int] = []
            _, mean, steady = eb.pipelined_step_times(self.engine, self.batch, steps, self.device, contexts)
        ctx = statistics.fmean(contexts)
        e = self.engine
        traffic = eb.decode_traffic(e.model_config, e.dtype, e.ssm_dtype, self.batch, ctx)
        roof = traffic.total / (self.copy * 1e9) * 1e3
        return Point(name, self.batch, rnd, steady if steady is not None else mean, ctx / self.batch, roof)

    def close(self) -> None:
        self._recapture()  # the tree's own settings again
        for rid in self.ids:
            self.engine.abort(rid)


def tree_settings(cfg: ModelConfig, batch: int) -> str:
    """What `base` runs at this batch: the state update's (rows per program, warps) and decode attention's key
    tile and warps, as the tree picks them for the model's shapes."""
    import baton.engine.ops.attention.kernel as ta
    import baton.engine.ops.ssm_update.kernel as ts

    bp, _, nw = ts._launch_config(cfg.mamba_head_dim, cfg.ssm_state_size, batch=batch)
    _, _, bn, _, aw = ta._launch_config(cfg.num_attention_heads // cfg.num_key_value_heads, cfg.head_dim, 1,
                                        batch, batch)
    return f"ssu.block_p={bp}+ssu.warps={nw}+attn.block_n={bn}+attn.warps={aw}+attn.stages={ta.DECODE_STAGES}"


def summary(points: list[Point], trees: dict[int, str] | None = None) -> str:
    """The table: per batch and variant, the step times and the mean step / roofline against `base`'s;
    above it, what `base` runs at each batch (`trees`)."""
    lines = [f"- batch {b}: `base` = `{t}`" for b, t in (trees or {}).items()]
    lines += [""] if lines else []
    lines += ["| batch | variant | step ms (rounds) | step / roofline (mean) | vs base |",
              "| ---: | --- | --- | ---: | ---: |"]
    for b in sorted({p.batch for p in points}):
        by: dict[str, list[Point]] = {}
        for p in points:
            if p.batch == b:
                by.setdefault(p.variant, []).append(p)
        base = statistics.fmean(p.ratio for p in by["base"]) if "base" in by else math.nan
        for v, ps in by.items():
            r = statistics.fmean(p.ratio for p in ps)
            lines.append(f"| {b} | `{v}` | {' / '.join(f'{p.step_ms:.3f}' for p in ps)} | {r:.4f} | "
                         f"{100 * (r / base - 1):+.2f} % |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny preset (plumbing only)")
    ap.add_argument("--batches", default=None,
                    help="decode batch sizes, comma-separated (default 256; smoke 4)")
    ap.add_argument("--variants", default="base,ssu.warps=2,attn.block_n=64",
                    help="comma-separated variants (module docstring); 'base' is added first if missing")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None,
                    help="timed steps per measurement (default 30; smoke 3)")
    ap.add_argument("--context", type=int, default=None,
                    help="prompt tokens per request (default 1024; smoke 24)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    names = [v.strip() for v in a.variants.split(",") if v.strip()]
    if "base" not in names:
        names.insert(0, "base")
    variants = {v: parse_variant(v) for v in names}
    if a.rounds < 1:
        ap.error(f"--rounds: expected >= 1, got {a.rounds}")
    device = "cpu" if a.smoke or not torch.cuda.is_available() else "cuda"
    batches = eb._int_list("--batches", a.batches or ("4" if device == "cpu" else "256"))
    steps = a.steps or (3 if device == "cpu" else 30)
    context = a.context or (24 if device == "cpu" else 1024)
    if steps < 2:
        ap.error(f"--steps: expected >= 2, got {steps}")
    # Each measurement runs a drain step, 2 warm-up steps and `steps` timed ones; every batch's requests live
    # through all of them.
    tokens = len(variants) * a.rounds * (steps + 3) + 8
    dev = torch.device(device)
    gpu = device == "cuda"
    copy = eb.copy_gbps((1024 if gpu else 8) * 2**20, dev)
    bc = eb.BenchConfig(device=device, preset="8b-like" if gpu else "tiny", batches=batches, context=context,
                        steps=tokens // 2 + 1, prefill_tokens=8192 if gpu else 64, prefill_splits=(1,),
                        prefill_continued=False, mixed_batch=0, seed=a.seed, progress=not a.no_progress)
    engine = eb.build_engine(bc)
    points: list[Point] = []
    trees = {b: tree_settings(engine.model_config, b) for b in batches}
    for b in batches:
        probe = Probe(engine, b, context, tokens, copy, a.seed + b)
        todo = [(r, v) for r in range(a.rounds) for v in variants]
        for r, v in tqdm(todo, desc=f"B={b}", disable=a.no_progress):
            points.append(probe.measure(v, variants[v], r, steps))
        probe.close()
    command = "python benchmarks/launch_probe.py " + " ".join(argv if argv is not None else sys.argv[1:])
    meta = {"device_name": device_name(dev), "commit": git_commit(), "command": command, "copy_gbps": copy,
            "preset": bc.preset, "graphs": engine.runner.graphs is not None and engine.runner.graphs.capture,
            "base": trees}
    print(f"## Launch settings in whole decode steps — {meta['device_name']}, commit {meta['commit']}, "
          f"{bc.preset}, context {context}; copy {copy:.0f} GB/s\n\n`{command}`\n")
    print(summary(points, trees))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"meta": meta, "points": [dataclasses.asdict(p) | {"ratio": p.ratio}
                                                               for p in points]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
