"""The Qwen3.5 presets of `make_model`: HF `Qwen3_5TextConfig` dicts (the layout `Qwen3_5ForCausalLM` saves) and
how each of its tensors is drawn.

Presets: `qwen3.5-tiny` (CPU tests and demos: three Gated DeltaNet layers to one gated-attention layer, GQA on both,
key and value head dims that differ) and `qwen3.5-27b-like` (the released Qwen3.5-27B's text model: 64 layers,
hidden 5120, bf16). Norm weights get a small random spread (HF initialises Qwen3.5's zero-centred norms to zero),
so that a load that folded or skipped them wrongly changes the logits.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

QWEN3_5_COMMON: dict[str, Any] = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    "tie_word_embeddings": False,
    "use_cache": True,
}

QWEN3_5_PRESETS: dict[str, dict[str, Any]] = {
    "qwen3.5-tiny": {
        "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 24,
        "max_position_embeddings": 4096, "torch_dtype": "float32",
    },
    # Qwen/Qwen3.5-27B's text_config.
    "qwen3.5-27b-like": {
        "vocab_size": 248320, "hidden_size": 5120, "num_hidden_layers": 64, "intermediate_size": 17408,
        "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256, "linear_num_key_heads": 16,
        "linear_num_value_heads": 48, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "max_position_embeddings": 262144, "torch_dtype": "bfloat16",
    },
}

# Every field HF Qwen3_5TextConfig (transformers 5.x) or its PreTrainedConfig base accepts: `--set` refuses others.
QWEN3_5_KNOWN_KEYS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps", "use_cache",
    "tie_word_embeddings", "rope_parameters", "attention_bias", "attention_dropout", "head_dim",
    "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
    "linear_num_value_heads", "layer_types", "full_attention_interval", "pad_token_id", "bos_token_id",
    "eos_token_id", "mtp_num_hidden_layers", "mamba_ssm_dtype",
    "architectures", "model_type", "dtype", "torch_dtype", "transformers_version",
})


def init_qwen3_5_tensor(name: str, shape: tuple[int, ...], num_layers: int, conv_kernel: int,
                        g: torch.Generator) -> torch.Tensor:
    """A random fp32 value for canonical tensor `name` of a Qwen3.5 text model, from generator `g`."""
    leaf = name.rsplit(".", 1)[-1]

    def normal(std: float) -> torch.Tensor:
        return torch.randn(shape, generator=g, dtype=torch.float32, device=g.device).mul_(std)

    if name == "model.embed_tokens.weight":
        return normal(1.0)
    if name == "lm_head.weight":
        return normal(2.0 / math.sqrt(shape[-1]))  # logits std ~2
    if name.endswith("linear_attn.norm.weight"):
        return 1.0 + normal(0.1)  # a plain gated norm: weights around 1
    if "norm" in name.rsplit(".", 2)[-2]:
        return normal(0.1)  # zero-centred (layer norms, q/k norms, the MTP's norms): the norm multiplies by 1 + w
    if leaf == "A_log":
        # Computed on the CPU: a constant must not depend on the draw device.
        return torch.log(torch.linspace(1.0, 16.0, shape[0], dtype=torch.float32)).to(g.device)
    if leaf == "dt_bias":
        return normal(0.5)
    if "conv1d" in name:
        bound = 1.0 / math.sqrt(conv_kernel)
        return torch.rand(shape, generator=g, dtype=torch.float32, device=g.device).mul_(2 * bound).sub_(bound)
    std = 1.0 / math.sqrt(shape[-1])
    if name.endswith(("out_proj.weight", "o_proj.weight", "down_proj", "down_proj.weight")):
        std /= math.sqrt(2 * num_layers)  # residual-branch outputs, two per decoder layer
    return normal(std)


def qwen3_5_config(preset: str, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The config dict of `preset` with `overrides` (already checked against QWEN3_5_KNOWN_KEYS)."""
    d = {**QWEN3_5_COMMON, **QWEN3_5_PRESETS[preset], **overrides}
    if "layer_types" not in overrides:
        interval = d["full_attention_interval"]
        d["layer_types"] = ["linear_attention" if (i + 1) % interval else "full_attention"
                            for i in range(d["num_hidden_layers"])]
    return d
