"""Test helper: a made model rewritten as a block-wise FP8 checkpoint of any block size (`make-model --quantize
fp8-block` writes 128 x 128, which is one partial block of the tiny presets' layers)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from baton.engine.fp8_checkpoint import quantize_for_checkpoint, unquantized_linears
from baton.engine.quant_config import FP8, FP8Config


def quantize_blockwise(out: Path, block: tuple[int, int]) -> None:
    """Rewrite made model `out` (one `model.safetensors`) as a block-wise FP8 checkpoint of `block`-sized blocks."""
    state = load_file(out / "model.safetensors")
    qcfg = FP8Config(FP8, block, "dynamic", tuple(unquantized_linears({n: tuple(t.shape) for n, t in state.items()})))
    save_file({k: v for n, t in state.items() for k, v in quantize_for_checkpoint(n, t.float(), qcfg).items()},
              out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": qcfg.to_hf_dict()}, indent=2))
