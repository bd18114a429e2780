"""`baton make-model OUT --preset NAME`: write a random NemotronH or Qwen3.5 checkpoint."""

from __future__ import annotations

import argparse
from pathlib import Path

from baton.engine.config import SUPPORTED_DTYPES, ModelConfig
from baton.engine.loader import read_hf_config
from baton.engine.make_model import (
    DEFAULT_SHARD_SIZE_BYTES,
    PRESET_NAMES,
    QUANTIZE_CHOICES,
    make_model,
    parse_overrides,
)
from baton.engine.weights import expected_weight_shapes, num_parameters


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("make-model", help="write a random NemotronH or Qwen3.5 checkpoint (config.json + safetensors)")
    p.add_argument("out", type=Path, help="output directory")
    p.add_argument("--preset", choices=PRESET_NAMES, default="tiny", help="model shape (default: tiny)")
    p.add_argument("--mtp-layers", type=int, default=0, metavar="N",
                   help="number of MTP steps (num_nextn_predict_layers); 0 = no MTP weights")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=SUPPORTED_DTYPES, default=None, help="weight dtype (default: the preset's)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config.json field; VALUE is JSON when it parses, else a string (repeatable)")
    p.add_argument("--shard-size-mb", type=int, default=DEFAULT_SHARD_SIZE_BYTES // 2**20,
                   help="largest safetensors file before sharding (default: %(default)s)")
    p.add_argument("--device", default="cpu",
                   help="where the weights are drawn: cpu (default) or cuda (seconds for 8b-like; other values "
                        "than the CPU's for the same seed)")
    p.add_argument("--no-tokenizer", dest="tokenizer", action="store_false",
                   help="do not write tokenizer.json / tokenizer_config.json (default: a small byte-level BPE)")
    p.add_argument("--quantize", choices=QUANTIZE_CHOICES, default=None,
                   help="write FP8 weights: fp8 = ModelOpt per-tensor scales (weight_scale), fp8-block = 128x128 "
                        "block scales (weight_scale_inv); every Linear but the MoE routers and lm_head "
                        "(default: unquantized)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    out = make_model(args.out, preset=args.preset, mtp_layers=args.mtp_layers, seed=args.seed,
                     overrides=parse_overrides(args.overrides), dtype=args.dtype,
                     shard_size_bytes=args.shard_size_mb * 2**20, tokenizer=args.tokenizer,
                     device=args.device, quantize=args.quantize)
    cfg = ModelConfig.from_hf_dict(read_hf_config(out))
    params = num_parameters(expected_weight_shapes(cfg))
    size = sum(f.stat().st_size for f in out.glob("model*.safetensors"))
    weights = cfg.torch_dtype if args.quantize is None else f"{args.quantize} ({cfg.torch_dtype} rest)"
    print(f"{out}: {args.preset}, {params / 1e6:.2f}M parameters ({cfg.pattern}, "
          f"{cfg.num_nextn_predict_layers} MTP), {weights}, {size / 2**20:.1f} MiB")
    return 0
