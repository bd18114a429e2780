"""Load an HF NemotronH checkpoint directory: `config.json` + safetensors (single file or sharded).

Names are canonicalised (`weights.canonicalize_names`) and checked against `expected_weight_shapes`:
anything missing, unexpected or of the wrong shape is a `ValueError` that lists it. Tensors are cast to
the requested dtype except the MoE router (`gate.weight`, `gate.e_score_correction_bias`), which stays fp32
as in HF. The returned names are exactly those of `expected_weight_shapes(cfg)`: with `tie_word_embeddings`
there is no `lm_head.weight` (the model reuses `model.embeddings.weight`; a stored one is ignored).

FP8 checkpoints (`quant_config.py`: ModelOpt per-tensor, block-wise `fp8`): the FP8 Linears keep their
float8_e4m3fn weights, and their scales (`*.weight_scale` / `*.weight_scale_inv`, `*.input_scale`, fp32) are
returned beside them; the rest is `fp8_checkpoint.prepare_fp8`'s. `cfg.quantization` says which format.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from baton.engine.config import SUPPORTED_DTYPES, ModelConfig
from baton.engine.fp8_checkpoint import is_fp8_sidecar, prepare_fp8
from baton.engine.kv_cache_dtype import is_kv_scale
from baton.engine.ops.fp8_linear.reference import FP8_DTYPE
from baton.engine.quant_config import read_quant_config
from baton.engine.weights import (
    CONFIG_FILE,
    FP8_SCALE_SUFFIXES,
    FP32_SUFFIXES,
    INDEX_FILE,
    MTP_PREFIX,
    SINGLE_FILE,
    TORCH_DTYPES,
    canonicalize_names,
    expected_weight_shapes,
)

logger = logging.getLogger(__name__)
_SHOW = 8  # how many offending names an error message lists


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"config.json: expected a file at {path}, found none")
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"config.json: expected valid JSON in {path}, got a parse error: {e}") from e
    if not isinstance(d, dict):
        raise ValueError(f"config.json: expected a JSON object in {path}, got {type(d).__name__}")
    return d


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{INDEX_FILE}: expected JSON with a 'weight_map' object in {index}: {e!r}") from e
        missing = [f for f in files if not (model_dir / f).is_file()]
        if missing:
            raise ValueError(f"{INDEX_FILE}: shard file(s) {missing[:_SHOW]} listed but not found in {model_dir}")
        return [model_dir / f for f in files]
    if (model_dir / SINGLE_FILE).is_file():
        return [model_dir / SINGLE_FILE]
    raise ValueError(f"weights: expected {SINGLE_FILE} or {INDEX_FILE} in {model_dir}, found neither")


def _listing(kind: str, names: list[str]) -> str:
    more = f" (and {len(names) - _SHOW} more)" if len(names) > _SHOW else ""
    return f"{len(names)} {kind}: {', '.join(names[:_SHOW])}{more}"


def read_model_config(model_dir: str | Path) -> ModelConfig:
    """`model_dir`'s config (with its quantization), without reading any weights."""
    hf = read_hf_config(model_dir)
    cfg = ModelConfig.from_hf_dict(hf)
    quant = read_quant_config(Path(model_dir), hf)
    return cfg if quant == cfg.quantization else dataclasses.replace(cfg, quantization=quant)


def load_checkpoint(model_dir: str | Path, dtype: str | None = None,
                    device: str | torch.device = "cpu") -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read `model_dir`; return its config (torch_dtype = the dtype loaded) and canonical name -> tensor."""
    model_dir = Path(model_dir)
    cfg = read_model_config(model_dir)
    target = dtype or cfg.torch_dtype
    if target not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype: expected one of {', '.join(SUPPORTED_DTYPES)}, got {target!r}")

    raw: dict[str, torch.Tensor] = {}
    for file in _weight_files(model_dir):
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                if name in raw:
                    raise ValueError(f"weights: tensor '{name}' appears in more than one file ({file.name})")
                t = f.get_tensor(name)
                keep_fp32 = name.endswith(FP32_SUFFIXES) or name.endswith(FP8_SCALE_SUFFIXES)
                if t.is_floating_point() and t.dtype != FP8_DTYPE:
                    t = t.to(torch.float32 if keep_fp32 else TORCH_DTYPES[target])
                raw[name] = t
    prepare_fp8(raw, cfg.quantization, TORCH_DTYPES[target])
    state = canonicalize_names(raw, cfg)
    del raw

    if cfg.num_nextn_predict_layers == 0:
        mtp = [n for n in state if n.startswith(MTP_PREFIX)]
        if mtp:
            logger.warning("%s: ignoring %d mtp.* tensors: config.json declares no MTP layers",
                           model_dir, len(mtp))
            for n in mtp:
                del state[n]
    if cfg.tie_word_embeddings and "lm_head.weight" in state:
        logger.warning("%s: ignoring lm_head.weight: config.json sets tie_word_embeddings=true", model_dir)
        del state["lm_head.weight"]

    expected = expected_weight_shapes(cfg)
    problems = []
    missing = [n for n in expected if n not in state]
    if missing:
        problems.append(_listing("missing", missing))
    unexpected = sorted(n for n in state if n not in expected and not is_fp8_sidecar(n, state) and not is_kv_scale(n))
    if unexpected:
        problems.append(_listing("unexpected", unexpected))
    mismatched = [f"{n} expected {list(s)} got {list(state[n].shape)}"
                  for n, s in expected.items() if n in state and tuple(state[n].shape) != s]
    if mismatched:
        problems.append(_listing("with the wrong shape", mismatched))
    if problems:
        raise ValueError(f"weights in {model_dir} do not match config.json: " + "; ".join(problems))

    if target != cfg.torch_dtype:
        cfg = dataclasses.replace(cfg, torch_dtype=target)
    return cfg, state
