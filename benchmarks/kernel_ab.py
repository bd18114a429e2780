"""A/B of the prefill-path Triton kernels against an earlier commit's, on one GPU at the 8b-like layer's shapes.

The old kernels are the files of `--rev` (read with `git show`), imported beside the tree's own as modules of
their own, so both run in one process on the same inputs, alternated round by round. Each op's output is checked
against the torch reference (and the old kernel's) before it is timed.

  conv_varlen       the varlen causal conv of a prefill step: x a [T, conv_dim] view of in_proj's [T, 18,560]
                    output, T = 8,192 split into 1, 4 and 8 rows with initial states; µs per call
  prefill_attention causal attention of prefill steps (32 query / 8 KV heads of 128, blocks of 16): 1 x 8k, 4 x
                    2k, 8 x 1k and four rows of 1-3k tokens, two after a prefix; TFLOP/s of the causal FLOPs
  decode_attention  decode rows at ~1k context, batch 1, 32, 256, in CUDA graphs of 20 calls; µs per call

  python benchmarks/kernel_ab.py --rev d357d00 --out /tmp/ab          # on a GPU
"""

from __future__ import annotations

import argparse
import atexit
import functools
import importlib.util
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.run_info import device_name, git_commit  # noqa: E402

JSON_NAME = "kernel_ab.json"
OPS = ("conv_varlen", "prefill_attention", "decode_attention")
FILES = {"conv_varlen": "engine/ops/conv/kernel_varlen.py", "prefill_attention": "engine/ops/attention/kernel.py",
         "decode_attention": "engine/ops/attention/kernel.py"}
# The 8b-like layer: in_proj's output width, the conv's channels and width; attention heads and head size.
IN_PROJ_WIDTH, CONV_OFFSET, CONV_DIM, CONV_K = 18560, 8192, 10240, 4
Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
PREFILL_ROWS: dict[str, list[tuple[int, int]]] = {
    "1 x 8k": [(0, 8192)], "4 x 2k": [(0, 2048)] * 4, "8 x 1k": [(0, 1024)] * 8,
    "1-3k, 2 with prefix": [(1024, 1024), (0, 3000), (0, 2000), (512, 2000)],
}


@dataclass(frozen=True)
class Row:
    op: str
    case: str
    unit: str           # what old / new measure ("us" per call, or "TFLOP/s")
    old: list[float]    # one value per round
    new: list[float]
    max_err_new: float  # max |new - torch reference| (conv) or |new - old| (attention)

    @property
    def speedup(self) -> float:
        """old time / new time (rates: new / old), from the rounds' medians."""
        o, n = statistics.median(self.old), statistics.median(self.new)
        return n / o if self.unit == "TFLOP/s" else o / n


def module_at(rev: str, path: str, name: str) -> ModuleType:
    """The file `path` as it was at `rev`, imported as module `name` (its own imports resolve to the tree's)."""
    try:
        source = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True,
                                check=True, timeout=30).stdout
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"kernel_ab: expected {path} at revision {rev!r}, git said: {e.stderr.strip()}") from None
    # Triton reads a kernel's source from its file: write it out rather than exec a string (removed at exit).
    directory = tempfile.mkdtemp(prefix="kernel_ab_")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    tmp = Path(directory) / f"{name}.py"
    tmp.write_text(source)
    spec = importlib.util.spec_from_file_location(name, tmp)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def time_us(fn: Callable[[], object], iters: int = 20, graph: bool = False) -> float:
    for _ in range(3):
        fn()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(iters):
                fn()
        run = g.replay
        calls = 5
    else:
        def run():
            for _ in range(iters):
                fn()
        calls = 1
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (iters * calls)


def ab_conv(old: ModuleType, new: ModuleType, rounds: int) -> list[Row]:
    from baton.engine.ops.conv.reference import causal_conv1d_varlen
    T = 8192
    g = torch.Generator(device="cuda").manual_seed(0)
    z = torch.randn(T, IN_PROJ_WIDTH, device="cuda", dtype=torch.bfloat16, generator=g)
    x = z[:, CONV_OFFSET:CONV_OFFSET + CONV_DIM]
    w = (torch.randn(CONV_DIM, CONV_K, device="cuda", generator=g) * 0.3).to(torch.bfloat16)
    b = torch.randn(CONV_DIM, device="cuda", generator=g).to(torch.bfloat16)
    rows_out = []
    for rows in (1, 4, 8):
        qsl = torch.arange(0, T + 1, T // rows, device="cuda", dtype=torch.int32)
        slots = torch.arange(rows, device="cuda", dtype=torch.int32) * 2
        init = torch.ones(rows, dtype=torch.bool, device="cuda")
        pool = torch.randn(2 * rows, CONV_DIM, CONV_K - 1, device="cuda", generator=g).to(torch.bfloat16)
        pools = [pool.clone() for _ in range(3)]
        ref = causal_conv1d_varlen(x, w, b, pools[0], qsl, slots, init)
        y_old = old.causal_conv1d_varlen_triton(x, w, b, pools[1], qsl, slots, init)
        y_new = new.causal_conv1d_varlen_triton(x, w, b, pools[2], qsl, slots, init)
        for name, y, p in (("old", y_old, pools[1]), ("new", y_new, pools[2])):
            torch.testing.assert_close(y, ref, atol=2e-2, rtol=2e-2, msg=lambda m, n=name: f"conv {n}: {m}")
            if not torch.equal(p, pools[0]):
                raise RuntimeError(f"conv {name}: final windows differ from the reference's")
        times: dict[str, list[float]] = {"old": [], "new": []}
        calls = {name: functools.partial(mod.causal_conv1d_varlen_triton, x, w, b, p, qsl, slots, init)
                 for name, mod, p in (("old", old, pools[1]), ("new", new, pools[2]))}
        for _ in range(rounds):
            for name, call in calls.items():
                times[name].append(time_us(call))
        rows_out.append(Row("conv_varlen", f"8,192 tokens in {rows} row{'s' * (rows > 1)}", "us", times["old"],
                            times["new"], (y_new.float() - ref.float()).abs().max().item()))
    return rows_out


def _attention_calls(old: ModuleType, new: ModuleType, rows: list[tuple[int, int]],
                     max_query_len: int) -> dict[str, Callable[[], torch.Tensor]]:
    """The old and the new kernel on one case (a cache holding the rows' keys on scattered blocks)."""
    from tests.test_ops_triton_attention import make_case
    q, kv, qsl, seq_lens, bt = make_case(rows, Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.bfloat16,
                                         device="cuda")
    args = (q, kv, qsl.cuda(), seq_lens.cuda(), bt.cuda(), HEAD_DIM**-0.5)
    return {name: functools.partial(m.paged_attention_triton, *args, max_query_len=max_query_len)
            for name, m in (("old", old), ("new", new))}


def causal_flops(rows: Sequence[tuple[int, int]]) -> float:
    """QK^T and PV over the causal keys: each query of a row at context c sees c + its position + 1 keys."""
    return sum(4 * HEAD_DIM * Q_HEADS * n * (c + (n + 1) / 2) for c, n in rows)


def ab_prefill_attention(old: ModuleType, new: ModuleType, rounds: int) -> list[Row]:
    out = []
    for case, rows in PREFILL_ROWS.items():
        call = _attention_calls(old, new, rows, max(n for _, n in rows))
        err = (call["new"]().float() - call["old"]().float()).abs().max().item()
        f = causal_flops(rows)
        rates: dict[str, list[float]] = {"old": [], "new": []}
        for _ in range(rounds):
            for name in ("old", "new"):
                rates[name].append(f / time_us(call[name]) / 1e6)
        out.append(Row("prefill_attention", case, "TFLOP/s", rates["old"], rates["new"], err))
    return out


def ab_decode_attention(old: ModuleType, new: ModuleType, rounds: int) -> list[Row]:
    out = []
    for batch in (1, 32, 256):
        call = _attention_calls(old, new, [(1064, 1)] * batch, 1)
        err = (call["new"]().float() - call["old"]().float()).abs().max().item()
        times: dict[str, list[float]] = {"old": [], "new": []}
        for _ in range(rounds):
            for name in ("old", "new"):
                times[name].append(time_us(call[name], graph=True))
        out.append(Row("decode_attention", f"batch {batch}, context 1,065", "us", times["old"], times["new"], err))
    return out


def table(rows: Sequence[Row], meta: dict) -> str:
    lines = [f"## Kernel A/B — {meta['device_name']}, {meta['rev']} (old) against {meta['commit']} (new)", "",
             f"`{meta['command']}`", "",
             "| op | case | unit | old (rounds) | new (rounds) | new / old speed | max err |",
             "| --- | --- | --- | --- | --- | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r.op} | {r.case} | {r.unit} | {' / '.join(f'{v:.1f}' for v in r.old)} | "
                     f"{' / '.join(f'{v:.1f}' for v in r.new)} | **{r.speedup:.2f}×** | {r.max_err_new:.2g} |")
    return "\n".join(lines)


def parse_ops(text: str) -> list[str]:
    ops = [o.strip() for o in text.split(",") if o.strip()]
    bad = [o for o in ops if o not in OPS]
    if bad or not ops:
        raise SystemExit(f"--ops: expected a comma-separated subset of {', '.join(OPS)}, got {text!r}")
    return ops


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", required=True, help="the commit whose kernels are the old side")
    ap.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {', '.join(OPS)}")
    ap.add_argument("--rounds", type=int, default=3, help="old/new alternations per case")
    ap.add_argument("--out", type=Path, help=f"directory for {JSON_NAME}")
    args = ap.parse_args(argv)
    ops = parse_ops(args.ops)
    if args.rounds < 1:
        raise SystemExit(f"--rounds: expected >= 1, got {args.rounds}")
    if not torch.cuda.is_available():
        raise SystemExit("kernel_ab: expected a CUDA device")
    from baton.engine.ops.attention import kernel as triton_attention
    from baton.engine.ops.conv import kernel_varlen as triton_conv_varlen
    new = {"conv_varlen": triton_conv_varlen, "prefill_attention": triton_attention,
           "decode_attention": triton_attention}
    runs = {"conv_varlen": ab_conv, "prefill_attention": ab_prefill_attention, "decode_attention": ab_decode_attention}
    rows: list[Row] = []
    for op in ops:
        old = module_at(args.rev, FILES[op], f"kernel_ab_old_{op}")
        rows += runs[op](old, new[op], args.rounds)
    command = " ".join(["python benchmarks/kernel_ab.py", *(sys.argv[1:] if argv is None else argv)])
    meta = {"device_name": device_name(torch.device("cuda")), "commit": git_commit(), "rev": args.rev,
            "command": command}
    print(table(rows, meta))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        data = {"meta": meta, "rows": [asdict(r) | {"speedup": r.speedup} for r in rows]}
        (args.out / JSON_NAME).write_text(json.dumps(data, indent=1))
        print(f"wrote {args.out / JSON_NAME}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
