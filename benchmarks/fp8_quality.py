"""FP8 quality check (issue #49 item 3): held-out perplexity of a checkpoint in its own dtype against the same
checkpoint quantized to FP8 by Baton (`make_model --quantize`'s quantizer, `fp8_checkpoint.quantize_state`), on the
MTP benchmark's corpus (`mtp_bench.stdlib_sources`: the Python standard library's sources, every
`--holdout-every`-th file held out).

The held-out token stream (the checkpoint's own tokenizer) is cut into `--windows` windows of `--seq-len` tokens;
each is one prefill through the engine, and its NLL is the mean over all predicted tokens. Reported per variant:
perplexity, its delta to the unquantized checkpoint (relative), max |Δlogit| relative to the largest logit, and
argmax agreement. Variants: `fp8` (ModelOpt per-tensor) and `fp8-block` (128x128 blocks) weights, and `kv-fp8`: the
unquantized weights with an FP8 KV cache (`--kv-cache-dtype fp8`, scale 1.0 or the checkpoint's `k_scale` / `v_scale`). On a GPU with FP8
tensor cores the FP8 layers run the FP8 GEMMs (activations quantized too); elsewhere the dequantizing reference,
which `--emulate-act-quant` makes round the activations through e4m3 as the GPU path does.

A random checkpoint predicts nothing, so its perplexity says little: use a trained one, e.g. the checkpoint
`benchmarks/mtp_bench.py --out DIR` trains. `--smoke` runs a random `tiny` model on a small corpus on the CPU.

  python benchmarks/fp8_quality.py --model DIR --device cuda --dtype bfloat16 --max-ppl-increase 0.01
  python benchmarks/fp8_quality.py --smoke
  python benchmarks/fp8_quality.py --preset 8b-like --device cuda --dtype bfloat16   # random weights: Δlogit only
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from baton.engine.engine_config import EngineConfig
from baton.engine.fp8_checkpoint import quantize_state
from baton.engine.layers.fp8_linear import FP8Linear
from baton.engine.llm_engine import LLMEngine
from baton.engine.loader import load_checkpoint
from baton.engine.make_model import FP8_BLOCK, make_model
from baton.engine.quant_config import FP8, MODELOPT, FP8Config
from baton.engine.sampling_params import SamplingParams
from baton.engine.tokenizer import load_tokenizer
from baton.engine.weights import TORCH_DTYPES

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.mtp_bench import stdlib_sources, token_stream  # noqa: E402

VARIANTS = {"fp8": FP8Config(MODELOPT, None, "static"), "fp8-block": FP8Config(FP8, FP8_BLOCK, "dynamic")}


@dataclasses.dataclass
class Row:
    variant: str
    ppl: float
    ppl_delta: float  # relative to the unquantized checkpoint's
    max_dlogit: float  # max |Δlogit| / max |logit| of the unquantized checkpoint
    argmax_agree: float


def window_logits(cfg, weights, windows: list[list[int]], device: str, dtype: str,
                  emulate_act_quant: bool, kv_cache_dtype: str = "auto") -> torch.Tensor:
    """fp32 logits [W, L, V] of one prefill per window, through the engine."""
    n, bs = len(windows[0]), 16
    ecfg = EngineConfig(device=device, dtype=dtype, max_num_seqs=1, max_num_batched_tokens=n, block_size=bs,
                        num_kv_blocks=-(-n // bs) + 4, max_model_len=n + 8, kv_cache_dtype=kv_cache_dtype)
    engine = LLMEngine(cfg, dict(weights), ecfg)
    for m in engine.model.modules():
        if isinstance(m, FP8Linear):
            m.emulate_act_quant = emulate_act_quant
    out = []
    for w in windows:
        rid = engine.add_request(w, SamplingParams(max_tokens=1))
        sched = engine.scheduler.schedule()
        with torch.inference_mode():
            ids, batch = engine.runner.build_batch(sched)
            out.append(engine.model.logits(engine.model(ids, batch)).float().cpu())
        engine.abort(rid)  # frees its blocks for the next window
    return torch.stack(out)


def perplexity(logits: torch.Tensor, windows: list[list[int]]) -> float:
    targets = torch.tensor([w[1:] for w in windows])
    nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return math.exp(nll.item())


def compare(ref: torch.Tensor, got: torch.Tensor, windows: list[list[int]], base_ppl: float, name: str) -> Row:
    ppl = perplexity(got, windows)
    return Row(name, ppl, ppl / base_ppl - 1, ((got - ref).abs().max() / ref.abs().max()).item(),
               (got.argmax(-1) == ref.argmax(-1)).float().mean().item())


def run(model_dir: Path, device: str, dtype: str, corpus_mb: float, holdout_every: int, windows: int,
        seq_len: int, emulate_act_quant: bool) -> tuple[float, list[Row]]:
    cfg, state = load_checkpoint(model_dir, dtype)
    if cfg.quantization is not None:
        raise ValueError(f"--model: expected an unquantized checkpoint, got one with {cfg.quantization}")
    tok = load_tokenizer(model_dir)
    if tok is None:
        raise ValueError(f"--model: expected a tokenizer.json in {model_dir}, found none")
    _, held = stdlib_sources(int(corpus_mb * 2**20), holdout_every)
    stream = token_stream(held, tok, cfg.eos_token_ids[0] if cfg.eos_token_ids else 0)
    if stream.numel() < windows * seq_len:
        raise ValueError(f"corpus: {stream.numel()} held-out tokens, expected at least --windows x --seq-len = "
                         f"{windows * seq_len}")
    step = stream.numel() // windows
    wins = [stream[i * step:i * step + seq_len].tolist() for i in range(windows)]
    ref = window_logits(cfg, state, wins, device, dtype, False)
    base = perplexity(ref, wins)
    rows = []
    for name, qcfg in VARIANTS.items():
        qc, qs = quantize_state(cfg, state, qcfg, TORCH_DTYPES[dtype])
        rows.append(compare(ref, window_logits(qc, qs, wins, device, dtype, emulate_act_quant), wins, base, name))
    rows.append(compare(ref, window_logits(cfg, state, wins, device, dtype, False, "fp8"), wins, base, "kv-fp8"))
    return base, rows


def table(base: float, dtype: str, rows: list[Row]) -> str:
    lines = [f"{'variant':<10} {'ppl':>10} {'Δppl':>8} {'max|Δlogit|':>12} {'argmax=':>8}",
             f"{dtype:<10} {base:>10.3f} {'':>8} {'':>12} {'':>8}"]
    lines += [f"{r.variant:<10} {r.ppl:>10.3f} {r.ppl_delta:>+8.2%} {r.max_dlogit:>12.4f} {r.argmax_agree:>8.3f}"
              for r in rows]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="an unquantized checkpoint directory with its tokenizer")
    ap.add_argument("--smoke", action="store_true", help="a random tiny model, small corpus, CPU")
    ap.add_argument("--preset", help="a random model of this make_model preset (e.g. 8b-like) with a trained "
                                     "tokenizer: its perplexity means nothing, its logit deltas do")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=sorted(TORCH_DTYPES))
    ap.add_argument("--corpus-mb", type=float, default=4.0, help="stdlib source bytes to read at most (MB)")
    ap.add_argument("--holdout-every", type=int, default=10)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--emulate-act-quant", action="store_true",
                    help="reference path: round activations through e4m3 as the GPU kernels do")
    ap.add_argument("--json", type=Path, help="write the numbers here")
    ap.add_argument("--max-ppl-increase", type=float, metavar="FRACTION",
                    help="exit 1 if a variant's perplexity exceeds the unquantized checkpoint's by more than this "
                         "(0.01: 1 %%)")
    args = ap.parse_args(argv)
    if sum((args.model is not None, args.smoke, args.preset is not None)) != 1:
        ap.error("give exactly one of --model DIR, --preset NAME and --smoke")
    if args.max_ppl_increase is not None and not args.max_ppl_increase >= 0:
        ap.error(f"--max-ppl-increase: expected a fraction >= 0, got {args.max_ppl_increase}")
    return args


def over_limit(rows: list[Row], max_increase: float) -> list[Row]:
    """The variants whose perplexity rose by more than `max_increase` (a fraction of the unquantized one's)."""
    return [r for r in rows if not r.ppl_delta <= max_increase]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if args.smoke:
            model = make_model(Path(tmp) / "tiny", "tiny", progress=False)
            args.corpus_mb, args.windows, args.seq_len = min(args.corpus_mb, 0.5), min(args.windows, 2), 32
        elif args.preset:
            model = make_model(Path(tmp) / args.preset, args.preset, progress=False)
        base, rows = run(model, args.device, args.dtype, args.corpus_mb, args.holdout_every, args.windows,
                         args.seq_len, args.emulate_act_quant)
    print(table(base, args.dtype, rows))
    if args.json:
        args.json.write_text(json.dumps({"base_ppl": base, "rows": [dataclasses.asdict(r) for r in rows],
                                         "args": {k: str(v) for k, v in vars(args).items()}}, indent=2) + "\n")
    if args.max_ppl_increase is not None:
        over = over_limit(rows, args.max_ppl_increase)
        for r in over:
            print(f"{r.variant}: perplexity {r.ppl_delta:+.2%}, expected at most {args.max_ppl_increase:+.2%}",
                  file=sys.stderr)
        if over:
            return 1
        print(f"every variant within {args.max_ppl_increase:+.2%} perplexity")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
