"""The FP8 quantization a checkpoint declares: its `quantization_config` parsed into one frozen value.

Two formats, as the checkpoints that ship them name their fields and tensors:

* ModelOpt per-tensor FP8 (NVIDIA's Nemotron FP8 checkpoints): `config.json` has
  `quantization_config = {"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": ...,
  "ignore": [...]}`, or the older sidecar `hf_quant_config.json` has
  `{"producer": {"name": "modelopt", ...}, "quantization": {"quant_algo": "FP8", "exclude_modules": [...]}}`.
  A quantized Linear `P` stores `P.weight` (float8_e4m3fn [out, in]), `P.weight_scale` (fp32 scalar) and
  usually `P.input_scale` (fp32 scalar, a static activation scale); w = weight * weight_scale.
* Block-wise FP8 (DeepSeek-V3, Qwen3 FP8): `quantization_config = {"quant_method": "fp8", "fmt": "e4m3",
  "activation_scheme": "dynamic", "weight_block_size": [128, 128], "modules_to_not_convert": [...]}`
  (vLLM's spelling of the list: `ignored_layers`). `P.weight` float8_e4m3fn and `P.weight_scale_inv`
  (fp32 [ceil(out/128), ceil(in/128)], multiplied in despite its name: w = weight * scale per 128x128 block);
  activations are quantized at run time per token and group of 128 input channels.
  `quant_method: "fp8"` without `weight_block_size` is per-tensor with `P.weight_scale` (and `P.input_scale`
  for `activation_scheme: "static"`).

Anything else (NVFP4, INT4 AWQ, per-channel FP8, e5m2, ...) is refused with a `ValueError` naming the field.
The ignore list names checkpoint modules (globs allowed, e.g. `model.layers.*.self_attn*`); which Linears are
FP8 is read from the tensors' dtypes, and the list only cross-checks them (`is_ignored`).
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODELOPT, FP8 = "modelopt", "fp8"
QUANT_METHODS = (MODELOPT, FP8)
HF_QUANT_CONFIG_FILE = "hf_quant_config.json"
WEIGHT_SCALE, WEIGHT_SCALE_INV, INPUT_SCALE = "weight_scale", "weight_scale_inv", "input_scale"
# An FP8 routed-expert stack `P` (3D, named without a `.weight` leaf) keeps its scales as `P_scale` / `P_scale_inv`:
# a Linear's names with the stack's name in place of `weight` (`layers.fp8_experts`).
STACK_SCALE, STACK_SCALE_INV = "_scale", "_scale_inv"
# The KV-cache scales a ModelOpt checkpoint with `kv_cache_quant_algo: FP8` adds to attention layers.
KV_SCALE_SUFFIXES = (".k_scale", ".v_scale")
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def _bad(field: str, expected: str, got: Any) -> ValueError:
    return ValueError(f"quantization_config field '{field}': expected {expected}, got {got!r}")


@dataclass(frozen=True)
class FP8Config:
    """How a checkpoint's FP8 Linears are stored and how their activations are quantized."""

    quant_method: str  # "modelopt" or "fp8"
    # (rows, cols) of the weight blocks sharing one scale; None: one scale per tensor.
    block_size: tuple[int, int] | None = None
    # "static": a stored `input_scale` per Linear (where stored); "dynamic": computed from each input.
    activation_scheme: str = "dynamic"
    ignore: tuple[str, ...] = ()
    kv_cache_quant_algo: str | None = None

    def __post_init__(self) -> None:
        if self.quant_method not in QUANT_METHODS:
            raise _bad("quant_method", " or ".join(map(repr, QUANT_METHODS)), self.quant_method)
        if self.activation_scheme not in ("static", "dynamic"):
            raise _bad("activation_scheme", "'static' or 'dynamic'", self.activation_scheme)
        if self.block_size is not None:
            if len(self.block_size) != 2 or any(not isinstance(b, int) or b <= 0 for b in self.block_size):
                raise _bad("weight_block_size", "two positive integers", list(self.block_size))
            if self.activation_scheme != "dynamic":
                raise _bad("activation_scheme", "'dynamic' with weight_block_size", self.activation_scheme)

    @property
    def scale_name(self) -> str:
        """The suffix of a quantized Linear's weight scale tensor."""
        return WEIGHT_SCALE_INV if self.block_size is not None else WEIGHT_SCALE

    def is_ignored(self, module: str) -> bool:
        """Whether the ignore list keeps checkpoint module `module` (e.g. `backbone.layers.4.mixer.in_proj`)
        out of FP8: an exact name, a glob, or a parent module of it."""
        return any(module == p or module.startswith(p + ".") or fnmatch.fnmatchcase(module, p) for p in self.ignore)

    def to_hf_dict(self) -> dict[str, Any]:
        """The `quantization_config` a checkpoint of this format carries in its config.json."""
        if self.quant_method == MODELOPT:
            return {"quant_method": MODELOPT, "quant_algo": "FP8", "kv_cache_quant_algo": self.kv_cache_quant_algo,
                    "ignore": list(self.ignore)}
        out: dict[str, Any] = {"quant_method": FP8, "fmt": "e4m3", "activation_scheme": self.activation_scheme,
                               "modules_to_not_convert": list(self.ignore)}
        if self.block_size is not None:
            out["weight_block_size"] = list(self.block_size)
        return out


def _names(d: dict, keys: tuple[str, ...]) -> tuple[str, ...]:
    for key in keys:
        v = d.get(key)
        if v is None:
            continue
        if not isinstance(v, list | tuple) or not all(isinstance(s, str) for s in v):
            raise _bad(key, "a list of module names", v)
        return tuple(v)
    return ()


def _modelopt(d: dict, ignore_keys: tuple[str, ...]) -> FP8Config:
    algo = d.get("quant_algo")
    if not isinstance(algo, str) or algo.upper() != "FP8":
        raise _bad("quant_algo", "'FP8' (per-tensor FP8; NVFP4, FP8_PER_CHANNEL_PER_TOKEN, W4A8_AWQ, "
                   "MIXED_PRECISION are not supported)", algo)
    kv = d.get("kv_cache_quant_algo")
    if kv is not None and kv != "FP8":
        raise _bad("kv_cache_quant_algo", "null or 'FP8'", kv)
    return FP8Config(MODELOPT, None, "static", _names(d, ignore_keys), kv)


def parse_quantization_config(d: Any) -> FP8Config | None:
    """`config.json`'s `quantization_config` (None or absent: an unquantized checkpoint)."""
    if d is None:
        return None
    if not isinstance(d, dict):
        raise _bad("quantization_config", "a JSON object", type(d).__name__)
    method = d.get("quant_method")
    if method == MODELOPT:
        return _modelopt(d, ("ignore", "exclude_modules"))
    if method == FP8:
        fmt = d.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise _bad("fmt", "'e4m3'", fmt)
        block = d.get("weight_block_size")
        if block is not None:
            if not isinstance(block, list | tuple):
                raise _bad("weight_block_size", "two positive integers", block)
            block = tuple(block)
        return FP8Config(FP8, block, d.get("activation_scheme", "dynamic"),
                         _names(d, ("modules_to_not_convert", "ignored_layers", "ignore")))
    raise _bad("quant_method", " or ".join(map(repr, QUANT_METHODS)), method)


def read_quant_config(model_dir: str | Path, hf_config: dict) -> FP8Config | None:
    """The checkpoint's FP8 format: config.json's `quantization_config`, else ModelOpt's `hf_quant_config.json`,
    else None."""
    if hf_config.get("quantization_config") is not None:
        return parse_quantization_config(hf_config["quantization_config"])
    path = Path(model_dir) / HF_QUANT_CONFIG_FILE
    if not path.is_file():
        return None
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{HF_QUANT_CONFIG_FILE}: expected valid JSON in {path}, got a parse error: {e}") from e
    q = d.get("quantization") if isinstance(d, dict) else None
    if not isinstance(q, dict):
        raise ValueError(f"{HF_QUANT_CONFIG_FILE}: expected an object with a 'quantization' object in {path}, "
                         f"got {type(q).__name__}")
    return _modelopt(q, ("exclude_modules", "ignore"))
