"""Write a random checkpoint (HF `config.json`, safetensors, a small tokenizer) for tests and demos.

NemotronH presets: `tiny` (unit tests), `tiny-moe` (unit tests of MoE layers: Mamba / MoE / attention interleaved
as in Nemotron 3 Nano, an attention + MoE MTP block), `small` (~29M parameters, `make demo` on a CPU), `8b-like`
(exactly the shape of nvidia/Nemotron-H-8B-Base-8K: 52 layers, hidden 4096, ~8.1B parameters, bf16),
`nano-30b-a3b-like` (the shape of nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B: 52 layers, 23 Mamba2, 23 MoE of 128
experts top-6 plus a shared expert, 6 attention, hidden 2688, ~31.6B parameters, bf16; with `--mtp-layers` an
attention + MoE MTP block, as the Nemotron 3 MTP checkpoints have). Qwen3.5 presets:
`qwen3.5-tiny`, `qwen3.5-27b-like` (`make_model_qwen3_5.py`). The weights follow the
spirit of HF `NemotronHPreTrainedModel._init_weights` (norms = 1, D = 1, A_log = log(1..H), dt_bias =
softplus^-1 of a log-uniform dt) but linears use std 1/sqrt(fan_in) and embeddings std 1, so that a random
model's mixers matter next to the embeddings and its logits are spread out (greedy decoding does not
repeat one token, top-2 logits are rarely near-ties). Every tensor is drawn from its own generator seeded
by (seed, name): the output is deterministic and independent of sharding. `device="cuda"` draws them on the
GPU (seconds for the 8b-like preset, against minutes on a CPU); CUDA's generator gives other values than the
CPU's for the same seed, deterministic again.

`quantize="fp8"` writes an FP8 checkpoint in ModelOpt's per-tensor format, `"fp8-block"` in the block-wise
(128x128) one (`quant_config.py`, `fp8_checkpoint.quantize_for_checkpoint`): the weights are drawn as without it,
then rounded. The writer has no calibration data, so it stores no static `input_scale`: the engine quantizes
activations dynamically.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from baton.engine.config import LEGACY_KEYS, ModelConfig
from baton.engine.fp8_checkpoint import quantizable, quantize_for_checkpoint, unquantized_linears
from baton.engine.layer_symbols import QWEN3_5
from baton.engine.make_model_qwen3_5 import (
    QWEN3_5_KNOWN_KEYS,
    QWEN3_5_PRESETS,
    init_qwen3_5_tensor,
    qwen3_5_config,
)
from baton.engine.quant_config import FP8, MODELOPT, FP8Config
from baton.engine.tokenizer_train import write_tokenizer
from baton.engine.weights import (
    CONFIG_FILE,
    FP32_SUFFIXES,
    INDEX_FILE,
    SINGLE_FILE,
    TORCH_DTYPES,
    expected_weight_shapes,
)

DEFAULT_SHARD_SIZE_BYTES = 2 * 1024**3

_COMMON: dict[str, Any] = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "hidden_dropout": 0.0,
    "initializer_range": 0.02,
    "layer_norm_epsilon": 1e-5,
    "mamba_hidden_act": "silu",
    "mamba_proj_bias": False,
    "use_bias": False,
    "use_conv_bias": True,
    "conv_kernel": 4,
    "expand": 2,
    "time_step_min": 0.001,
    "time_step_max": 0.1,
    "time_step_floor": 1e-4,
    "mamba_ssm_cache_dtype": "float32",
    "mlp_bias": False,
    "mlp_hidden_act": "relu2",
    "n_shared_experts": 1,
    "moe_latent_size": None,
    "routed_scaling_factor": 1.0,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "num_logits_to_keep": 1,
    "rescale_prenorm_residual": True,
    "residual_in_fp32": False,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "use_cache": True,
    "num_nextn_predict_layers": 0,
}

_PRESETS: dict[str, dict[str, Any]] = {
    # Two Mamba layers in a row, two attention layers, MLP layers; Triton-friendly dims (>= 16).
    "tiny": {
        "vocab_size": 512, "hidden_size": 64, "hybrid_override_pattern": "M*M-MM*-",
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 256,
        "mamba_num_heads": 8, "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2, "chunk_size": 16,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
        "moe_shared_expert_intermediate_size": 128, "max_position_embeddings": 4096, "torch_dtype": "float32",
    },
    # Nemotron 3 Nano's interleave (Mamba, MoE, attention) at unit-test size; MoE fields Triton-friendly (>= 16).
    "tiny-moe": {
        "vocab_size": 512, "hidden_size": 64, "hybrid_override_pattern": "MEM*EME",
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 64,
        "mamba_num_heads": 8, "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2, "chunk_size": 16,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 64, "routed_scaling_factor": 2.5, "max_position_embeddings": 4096,
        "torch_dtype": "float32",
    },
    "small": {
        "vocab_size": 8192, "hidden_size": 512, "hybrid_override_pattern": "M-M*-M-M*-M-",
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 2048,
        "mamba_num_heads": 16, "mamba_head_dim": 64, "ssm_state_size": 64, "n_groups": 2, "chunk_size": 64,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 512,
        "moe_shared_expert_intermediate_size": 1024, "max_position_embeddings": 8192, "torch_dtype": "float32",
    },
    # nvidia/Nemotron-H-8B-Base-8K config.json (MoE fields: HF defaults, used only by MTP "E" layers).
    "8b-like": {
        "vocab_size": 131072, "hidden_size": 4096,
        "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 21504,
        "mamba_num_heads": 128, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8, "chunk_size": 128,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 7688,
        "moe_shared_expert_intermediate_size": 7688, "max_position_embeddings": 8192, "torch_dtype": "bfloat16",
    },
    # nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16 config.json.
    "nano-30b-a3b-like": {
        "vocab_size": 131072, "hidden_size": 2688,
        "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
        "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128, "intermediate_size": 1856,
        "mamba_num_heads": 64, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8, "chunk_size": 128,
        "n_routed_experts": 128, "num_experts_per_tok": 6, "moe_intermediate_size": 1856,
        "moe_shared_expert_intermediate_size": 3712, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
        "max_position_embeddings": 262144, "torch_dtype": "bfloat16",
    },
}
PRESET_NAMES = (*_PRESETS, *QWEN3_5_PRESETS)
# MTP block pattern per preset when --mtp-layers > 0. Real NemotronH MTP checkpoints (Nemotron-3 Super)
# use "*E" (attention then MoE); the dense 8B shape gets a dense MTP block.
MTP_PATTERNS = {"tiny": "*E", "tiny-moe": "*E", "small": "*E", "8b-like": "*-", "nano-30b-a3b-like": "*E"}
QUANTIZE_CHOICES = ("fp8", "fp8-block")
FP8_BLOCK = (128, 128)  # DeepSeek-V3's and Qwen3's weight_block_size


def fp8_config(quantize: str, shapes: Mapping[str, tuple[int, ...]]) -> FP8Config:
    """The `FP8Config` a `--quantize` choice writes, its ignore list the Linears left unquantized."""
    ignore = tuple(unquantized_linears(dict(shapes)))
    if quantize == "fp8":
        return FP8Config(MODELOPT, None, "static", ignore)
    if quantize == "fp8-block":
        return FP8Config(FP8, FP8_BLOCK, "dynamic", ignore)
    raise ValueError(f"quantize: expected one of {', '.join(QUANTIZE_CHOICES)}, got {quantize!r}")

# Every field HF NemotronHConfig (transformers 5.x) or its PreTrainedConfig base accepts, plus the legacy
# names HF still reads. `--set` refuses anything else.
KNOWN_CONFIG_KEYS = frozenset({
    "attention_bias", "attention_dropout", "bos_token_id", "chunk_size", "conv_kernel", "eos_token_id", "expand",
    "head_dim", "hidden_dropout", "hidden_size", "initializer_range", "intermediate_size", "layer_norm_epsilon",
    "layers_block_type", "mamba_head_dim", "mamba_hidden_act", "mamba_num_heads", "mamba_proj_bias",
    "mamba_ssm_cache_dtype", "max_position_embeddings", "mlp_bias", "mlp_hidden_act", "moe_intermediate_size",
    "moe_latent_size", "moe_shared_expert_intermediate_size", "moe_shared_expert_overlap",
    "mtp_layers_block_type", "n_group", "n_groups", "n_routed_experts", "n_shared_experts", "norm_topk_prob",
    "num_attention_heads", "num_experts_per_tok", "num_key_value_heads", "num_logits_to_keep",
    "num_nextn_predict_layers", "output_router_logits", "pad_token_id", "rescale_prenorm_residual",
    "residual_in_fp32", "routed_scaling_factor", "sliding_window", "ssm_state_size", "tie_word_embeddings",
    "time_step_floor", "time_step_limit", "time_step_max", "time_step_min", "topk_group", "use_bias",
    "use_cache", "use_conv_bias", "use_mamba_kernels", "vocab_size",
    # PreTrainedConfig
    "architectures", "model_type", "dtype", "torch_dtype", "transformers_version", "output_hidden_states",
    "output_attentions", "return_dict", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id",
    "problem_type",
    # legacy names
    "num_hidden_layers", "hybrid_override_pattern", "mtp_hybrid_override_pattern", "mamba_dt_init_floor",
    *LEGACY_KEYS,
})
_LEGACY_TO_CURRENT = {**LEGACY_KEYS, "mamba_dt_init_floor": "time_step_floor"}


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """`["vocab_size=8", "hybrid_override_pattern=M*M"]` -> `{"vocab_size": 8, ...}` (JSON value, else str)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--set: expected KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def build_config(preset: str, mtp_layers: int = 0, overrides: Mapping[str, Any] | None = None,
                 dtype: str | None = None) -> dict[str, Any]:
    """The HF config dict `make_model` writes, validated through `ModelConfig.from_hf_dict`."""
    if preset not in PRESET_NAMES:
        raise ValueError(f"preset: expected one of {', '.join(PRESET_NAMES)}, got {preset!r}")
    if not isinstance(mtp_layers, int) or mtp_layers < 0:
        raise ValueError(f"mtp_layers: expected an integer >= 0, got {mtp_layers!r}")
    if preset in QWEN3_5_PRESETS:
        return _build_qwen3_5(preset, mtp_layers, dict(overrides or {}), dtype)
    d: dict[str, Any] = {**_COMMON, **_PRESETS[preset]}
    if mtp_layers:
        d["num_nextn_predict_layers"] = mtp_layers
        d["mtp_hybrid_override_pattern"] = MTP_PATTERNS[preset]
    overrides = dict(overrides or {})
    unknown = sorted(k for k in overrides if k not in KNOWN_CONFIG_KEYS)
    if unknown:
        raise ValueError(f"--set: unknown config key(s) {', '.join(map(repr, unknown))}: expected fields of "
                         f"HF NemotronHConfig (e.g. vocab_size, hybrid_override_pattern, num_attention_heads)")
    # One spelling per field, else HF and ModelConfig could each read a different one.
    for old, new in _LEGACY_TO_CURRENT.items():
        if old in overrides:
            overrides[new] = overrides.pop(old)
    if "layers_block_type" in overrides:
        d.pop("hybrid_override_pattern", None)
    if "mtp_layers_block_type" in overrides:
        d.pop("mtp_hybrid_override_pattern", None)
    if "dtype" in overrides:
        value = overrides.pop("dtype")
        if overrides.setdefault("torch_dtype", value) != value:
            raise ValueError(f"--set dtype={value!r} and torch_dtype={overrides['torch_dtype']!r} disagree")
    if dtype is not None and overrides.setdefault("torch_dtype", dtype) != dtype:
        raise ValueError(f"dtype: --dtype {dtype!r} and --set torch_dtype={overrides['torch_dtype']!r} disagree")
    d.update(overrides)
    if d.get("num_nextn_predict_layers") and not d.get("mtp_hybrid_override_pattern") \
            and not d.get("mtp_layers_block_type"):
        d["mtp_hybrid_override_pattern"] = MTP_PATTERNS[preset]
    cfg = ModelConfig.from_hf_dict(d)
    if "num_hidden_layers" not in overrides:
        d["num_hidden_layers"] = cfg.num_layers
        cfg = ModelConfig.from_hf_dict(d)
    if "expand" not in overrides:
        d["expand"] = max(1, cfg.mamba_intermediate_size // cfg.hidden_size)
    return d


def _build_qwen3_5(preset: str, mtp_layers: int, overrides: dict[str, Any], dtype: str | None) -> dict[str, Any]:
    if mtp_layers and overrides.setdefault("mtp_num_hidden_layers", mtp_layers) != mtp_layers:
        raise ValueError(f"mtp_layers: --mtp-layers {mtp_layers} and --set mtp_num_hidden_layers="
                         f"{overrides['mtp_num_hidden_layers']!r} disagree")
    unknown = sorted(k for k in overrides if k not in QWEN3_5_KNOWN_KEYS)
    if unknown:
        raise ValueError(f"--set: unknown config key(s) {', '.join(map(repr, unknown))}: expected fields of "
                         f"HF Qwen3_5TextConfig (e.g. vocab_size, layer_types, linear_num_value_heads)")
    if "dtype" in overrides:
        value = overrides.pop("dtype")
        if overrides.setdefault("torch_dtype", value) != value:
            raise ValueError(f"--set dtype={value!r} and torch_dtype={overrides['torch_dtype']!r} disagree")
    if dtype is not None and overrides.setdefault("torch_dtype", dtype) != dtype:
        raise ValueError(f"dtype: --dtype {dtype!r} and --set torch_dtype={overrides['torch_dtype']!r} disagree")
    d = qwen3_5_config(preset, overrides)
    ModelConfig.from_hf_dict(d)  # refuses what the engine cannot run, naming the field
    return d


def _device(device: torch.device | str) -> torch.device:
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device: expected 'cpu' or 'cuda[:N]', got {device!r}") from e
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device: expected 'cpu' or 'cuda[:N]', got {device!r}")
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device: expected one of this machine's {torch.cuda.device_count()} CUDA devices, "
                         f"got {device!r}")
    return dev


def _generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator(device).manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def _normal(shape: tuple[int, ...], std: float, g: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=g, dtype=torch.float32, device=g.device).mul_(std)


def _uniform(shape: tuple[int, ...], bound: float, g: torch.Generator) -> torch.Tensor:
    return torch.rand(shape, generator=g, dtype=torch.float32, device=g.device).mul_(2 * bound).sub_(bound)


def init_tensor(name: str, shape: tuple[int, ...], cfg: ModelConfig, d: Mapping[str, Any], seed: int,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """A random fp32 value for checkpoint tensor `name` (canonical name, see `expected_weight_shapes`), made
    on `device`."""
    g = _generator(seed, name, torch.device(device))
    if cfg.family == QWEN3_5:
        return init_qwen3_5_tensor(name, shape, cfg.num_layers // 2, cfg.conv_kernel, g)
    leaf = name.rsplit(".", 1)[-1]
    # Residual-branch outputs are scaled by 1/sqrt(layers) (GPT-2 scheme, HF `rescale_prenorm_residual`).
    residual_scale = 1.0 / math.sqrt(cfg.num_layers)
    if name == "model.embeddings.weight":
        return _normal(shape, 1.0, g)
    if name == "lm_head.weight":
        return _normal(shape, 2.0 / math.sqrt(shape[-1]), g)  # logits std ~2
    if name.endswith("norm.weight") or name.endswith("norm_f.weight") or leaf == "D":
        return torch.ones(shape, dtype=torch.float32, device=g.device)
    if leaf == "A_log":
        # Computed on the CPU: a constant must not depend on the draw device (CUDA's log differs in the last bit).
        return torch.log(torch.arange(1, shape[0] + 1, dtype=torch.float32)).to(g.device)
    if leaf == "dt_bias":
        lo, hi = math.log(float(d["time_step_min"])), math.log(float(d.get("time_step_max", 0.1)))
        dt = torch.exp(torch.rand(shape, generator=g, device=g.device) * (hi - lo) + lo)
        dt = dt.clamp(min=float(d.get("time_step_floor", 1e-4)))
        return dt + torch.log(-torch.expm1(-dt))  # softplus^-1(dt)
    if "conv1d" in name:
        # nn.Conv1d default (kaiming_uniform, a=sqrt(5)): bound 1/sqrt(fan_in), fan_in = kernel (depthwise).
        return _uniform(shape, 1.0 / math.sqrt(cfg.conv_kernel), g)
    if leaf == "e_score_correction_bias":
        # HF initialises zeros; trained checkpoints have non-zero values, which tests should see.
        return _normal(shape, 0.1, g)
    if leaf == "bias":
        return torch.zeros(shape, dtype=torch.float32, device=g.device)
    std = 1.0 / math.sqrt(shape[-1])  # fan_in; experts [E, out, in] too
    if leaf in ("out_proj", "o_proj", "down_proj") or name.endswith(
            ("out_proj.weight", "o_proj.weight", "down_proj.weight", "fc2_latent_proj.weight")):
        std *= residual_scale
    return _normal(shape, std, g)


def _plan_shards(sizes: Mapping[str, int], shard_size_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > shard_size_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def make_model(out_dir: str | Path, preset: str = "tiny", mtp_layers: int = 0, seed: int = 0,
               overrides: Mapping[str, Any] | None = None, dtype: str | None = None,
               shard_size_bytes: int = DEFAULT_SHARD_SIZE_BYTES, progress: bool = True,
               tokenizer: bool = True, device: torch.device | str = "cpu", quantize: str | None = None) -> Path:
    """Write `config.json` and random safetensors weights of `preset` into `out_dir`; return `out_dir`.
    The weights are drawn on `device` (see the module docstring), then written from host memory.

    Weights larger than `shard_size_bytes` go to `model-0000i-of-0000N.safetensors` shards plus
    `model.safetensors.index.json`, one shard in memory at a time; smaller ones to `model.safetensors`.
    With `tokenizer`, also a small byte-level BPE `tokenizer.json` (see `tokenizer_train.write_tokenizer`).
    `quantize` ("fp8", "fp8-block"): an FP8 checkpoint (see the module docstring).
    """
    if shard_size_bytes <= 0:
        raise ValueError(f"shard_size_bytes: expected a positive integer, got {shard_size_bytes!r}")
    device = _device(device)
    d = build_config(preset, mtp_layers, overrides, dtype)
    cfg = ModelConfig.from_hf_dict(d)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("model*.safetensors"), out / INDEX_FILE]:
        stale.unlink(missing_ok=True)

    shapes = expected_weight_shapes(cfg)
    qcfg = None if quantize is None else fp8_config(quantize, shapes)
    if qcfg is not None:
        d["quantization_config"] = qcfg.to_hf_dict()
    dtypes = {n: torch.float32 if n.endswith(FP32_SUFFIXES) else TORCH_DTYPES[cfg.torch_dtype] for n in shapes}
    sizes = {n: math.prod(s) * (1 if qcfg is not None and quantizable(n, s) else dtypes[n].itemsize)
             for n, s in shapes.items()}
    shards = _plan_shards(sizes, shard_size_bytes)
    files = [SINGLE_FILE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    with tqdm(total=sum(sizes.values()), unit="B", unit_scale=True, desc=f"make-model {preset}",
              disable=not progress) as bar:
        weight_map, total = {}, 0
        for names, file in zip(shards, files, strict=True):
            tensors = {}
            for n in names:
                t = init_tensor(n, shapes[n], cfg, d, seed, device)
                # A quantized weight is rounded from the value the 16-bit checkpoint would store.
                parts = {n: t} if qcfg is None else quantize_for_checkpoint(n, t.to(dtypes[n]).float(), qcfg)
                for k, v in parts.items():
                    tensors[k] = (v if v.dtype == torch.float8_e4m3fn or k != n else v.to(dtypes[n])).cpu()
                    weight_map[k] = file
                    total += tensors[k].numel() * tensors[k].element_size()
                bar.update(sizes[n])
            save_file(tensors, str(out / file), metadata={"format": "pt"})
            del tensors
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (out / CONFIG_FILE).write_text(json.dumps(d, indent=2, sort_keys=True, allow_nan=False) + "\n")
    if tokenizer:
        write_tokenizer(out, d)
    return out
