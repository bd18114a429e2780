"""Model configuration: a hybrid model (NemotronH, Qwen3.5) described by an HF `config.json`.

`ModelConfig.from_hf_dict` accepts the field names HF transformers writes today, the legacy names of the
original NemotronH checkpoints (`hybrid_override_pattern`, `mamba_n_groups`, ...) and Qwen3.5's text config
(flat, or nested under `text_config` as the released checkpoints have it: `config_qwen3_5.py`). The engine sees
one pattern of blocks, each a residual branch around one mixer: a Qwen3.5 decoder layer is two blocks (its
token mixer, then its MLP). Anything we cannot run fails with a `ValueError` naming the field, the value we got
and the values we support.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from baton.engine.config_qwen3_5 import QWEN3_5_MODEL_TYPES, qwen3_5_fields
from baton.engine.layer_symbols import (
    ATTENTION,
    LAYER_SYMBOLS,
    MAMBA,
    MLP,
    MOE,
    NEMOTRON_H,
    RECURRENT_SYMBOLS,
)
from baton.engine.layer_symbols import config_error as _bad
from baton.engine.quant_config import FP8Config, parse_quantization_config

# HF's `layers_block_type` names for the same layers.
BLOCK_TYPE_TO_SYMBOL = {"linear_attention": MAMBA, "mamba": MAMBA, "full_attention": ATTENTION,
                        "attention": ATTENTION, "mlp": MLP, "moe": MOE}
SYMBOL_TO_BLOCK_TYPE = {MAMBA: "linear_attention", ATTENTION: "full_attention", MLP: "mlp", MOE: "moe"}

SUPPORTED_MLP_ACTS = ("relu2", "silu", "gelu", "relu")
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
# Legacy key -> current key (HF NemotronHConfig.__post_init__ does the same renames).
LEGACY_KEYS = {
    "mamba_n_groups": "n_groups",
    "mamba_d_conv": "conv_kernel",
    "mamba_expand": "expand",
    "mamba_dt_min": "time_step_min",
    "mamba_dt_max": "time_step_max",
    "mamba_dt_limit": "time_step_limit",
    "mamba_conv_bias": "use_conv_bias",
    "mamba_chunk_size": "chunk_size",
    "attention_head_dim": "head_dim",
    "mamba_ssm_cache_dtype": "mamba_ssm_cache_dtype",
}


def parse_pattern(pattern: str, field_name: str = "hybrid_override_pattern") -> tuple[str, ...]:
    if not isinstance(pattern, str) or not pattern:
        raise _bad(field_name, "a non-empty string of " + ", ".join(repr(s) for s in LAYER_SYMBOLS), pattern)
    bad = sorted({c for c in pattern if c not in LAYER_SYMBOLS})
    if bad:
        raise _bad(field_name, "only the layer symbols " + ", ".join(repr(s) for s in LAYER_SYMBOLS)
                   + " (M Mamba2, * attention, - MLP, E MoE)", pattern)
    return tuple(pattern)


def _block_types_to_symbols(types: Any, field_name: str) -> tuple[str, ...]:
    if not isinstance(types, list | tuple) or not types:
        raise _bad(field_name, "a non-empty list of layer types", types)
    out = []
    for t in types:
        if t not in BLOCK_TYPE_TO_SYMBOL:
            raise _bad(field_name, "entries among " + ", ".join(sorted(BLOCK_TYPE_TO_SYMBOL)), t)
        out.append(BLOCK_TYPE_TO_SYMBOL[t])
    return tuple(out)


@dataclass(frozen=True)
class ModelConfig:
    """Everything the engine needs to know about the model's shape. Immutable after load."""

    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]  # one symbol of LAYER_SYMBOLS per layer
    # attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    # MLP
    intermediate_size: int
    mlp_hidden_act: str = "relu2"
    mlp_bias: bool = False
    # Mamba2
    mamba_num_heads: int = 128
    mamba_head_dim: int = 64
    ssm_state_size: int = 128
    n_groups: int = 8
    conv_kernel: int = 4
    chunk_size: int = 128
    use_conv_bias: bool = True
    mamba_proj_bias: bool = False
    time_step_min: float = 0.001
    # MoE (only used by "E" layers)
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 7688
    moe_shared_expert_intermediate_size: int = 7688
    moe_latent_size: int | None = None
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    # misc
    layer_norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = (2,)
    bos_token_id: int | None = 1
    pad_token_id: int | None = 0
    max_position_embeddings: int = 4096
    torch_dtype: str = "float32"
    mamba_ssm_cache_dtype: str = "float32"
    # MTP drafter (reserved; used by the speculative decoding issue)
    num_nextn_predict_layers: int = 0
    mtp_layer_types: tuple[str, ...] = (ATTENTION, MOE)
    family: str = NEMOTRON_H
    # Gated DeltaNet (G blocks; its conv width is `conv_kernel`, its prefill chunk `chunk_size`)
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    # Qwen3.5 attention: RoPE on the first `rotary_dim` channels of each head (0: no positional embedding, as
    # NemotronH), per-head RMSNorm of q and k, and an output gate produced by q_proj beside the queries.
    rope_theta: float = 10000.0
    rotary_dim: int = 0
    qk_norm: bool = False
    attn_output_gate: bool = False
    # RMSNorm weights stored as offsets from 1 (Qwen3.5's zero-centred norms: out = norm(x) * (1 + w)).
    norm_zero_centered: bool = False
    mlp_gated: bool = False  # down(act(gate(x)) * up(x)) instead of down(act(up(x)))
    # Qwen3-Next's GDN projections: in_proj_qkvz / in_proj_ba grouped per key head (`weights_qwen3_5` splits them).
    gdn_interleaved_projections: bool = False
    # FP8 checkpoint format (`quant_config.py`); None: 16/32-bit weights.
    quantization: FP8Config | None = None
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "intermediate_size", "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups",
                     "conv_kernel", "chunk_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise _bad(name, "a positive integer", v)
        if self.conv_kernel < 2:
            raise _bad("conv_kernel", "an integer >= 2", self.conv_kernel)
        if self.num_attention_heads % self.num_key_value_heads:
            raise _bad("num_key_value_heads", f"a divisor of num_attention_heads={self.num_attention_heads}",
                       self.num_key_value_heads)
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise _bad("linear_num_key_heads", f"a divisor of linear_num_value_heads={self.linear_num_value_heads}",
                       self.linear_num_key_heads)
        if self.rotary_dim % 2 or not 0 <= self.rotary_dim <= self.head_dim:
            raise _bad("partial_rotary_factor", f"a rotary dimension that is even and in [0, head_dim={self.head_dim}]",
                       self.rotary_dim)
        if self.mamba_num_heads % self.n_groups:
            raise _bad("n_groups", f"a divisor of mamba_num_heads={self.mamba_num_heads}", self.n_groups)
        if self.mlp_hidden_act not in SUPPORTED_MLP_ACTS:
            raise _bad("mlp_hidden_act", "one of " + ", ".join(SUPPORTED_MLP_ACTS), self.mlp_hidden_act)
        if self.torch_dtype not in SUPPORTED_DTYPES:
            raise _bad("torch_dtype", "one of " + ", ".join(SUPPORTED_DTYPES), self.torch_dtype)
        if self.mamba_ssm_cache_dtype not in SUPPORTED_DTYPES:
            raise _bad("mamba_ssm_cache_dtype", "one of " + ", ".join(SUPPORTED_DTYPES), self.mamba_ssm_cache_dtype)
        if MOE in self.layer_types or (self.num_nextn_predict_layers and MOE in self.mtp_layer_types):
            if self.n_routed_experts % self.n_group:
                raise _bad("n_group", f"a divisor of n_routed_experts={self.n_routed_experts}", self.n_group)
            if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
                raise _bad("num_experts_per_tok", f"1..n_routed_experts={self.n_routed_experts}",
                           self.num_experts_per_tok)
        if self.num_nextn_predict_layers < 0:
            raise _bad("num_nextn_predict_layers", "an integer >= 0", self.num_nextn_predict_layers)
        for t in self.eos_token_ids:
            if not 0 <= t < self.vocab_size:
                raise _bad("eos_token_id", f"ids in [0, vocab_size={self.vocab_size})", t)

    # ---- derived shapes -------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def pattern(self) -> str:
        return "".join(self.layer_types)

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == ATTENTION)

    @property
    def mamba_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == MAMBA)

    @property
    def recurrent_layer_ids(self) -> tuple[int, ...]:
        """The blocks whose mixer keeps per-request state (Mamba2 or Gated DeltaNet): the state pools' layers."""
        return tuple(i for i, t in enumerate(self.layer_types) if t in RECURRENT_SYMBOLS)

    @property
    def gdn_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def gdn_conv_dim(self) -> int:
        """The Gated DeltaNet conv's channels: q, k and v."""
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    @property
    def mamba_intermediate_size(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        return self.mamba_intermediate_size + 2 * self.n_groups * self.ssm_state_size

    # ---- parsing --------------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict) -> ModelConfig:
        if not isinstance(d, dict):
            raise _bad("config.json", "a JSON object", type(d).__name__)
        model_type = d.get("model_type")
        if model_type in QWEN3_5_MODEL_TYPES:
            return cls(**qwen3_5_fields(d), quantization=parse_quantization_config(d.get("quantization_config")))
        if model_type != "nemotron_h":
            raise _bad("model_type", "one of 'nemotron_h', " + ", ".join(map(repr, QWEN3_5_MODEL_TYPES)), model_type)
        d = dict(d)
        for old, new in LEGACY_KEYS.items():
            if old in d and new not in d:
                d[new] = d[old]
        if d.get("hybrid_override_pattern") is not None:
            layer_types = parse_pattern(d["hybrid_override_pattern"])
        elif d.get("layers_block_type") is not None:
            layer_types = _block_types_to_symbols(d["layers_block_type"], "layers_block_type")
        else:
            raise _bad("hybrid_override_pattern", "a layer pattern (or 'layers_block_type')", None)
        n_hidden = d.get("num_hidden_layers")
        if n_hidden is not None and n_hidden != len(layer_types):
            raise _bad("num_hidden_layers", f"{len(layer_types)} (the length of the layer pattern)", n_hidden)
        if d.get("mtp_hybrid_override_pattern") is not None:
            mtp_types = parse_pattern(d["mtp_hybrid_override_pattern"], "mtp_hybrid_override_pattern")
        elif d.get("mtp_layers_block_type") is not None:
            mtp_types = _block_types_to_symbols(d["mtp_layers_block_type"], "mtp_layers_block_type")
        else:
            mtp_types = (ATTENTION, MOE)
        act = d.get("mamba_hidden_act", "silu")
        if act != "silu":
            raise _bad("mamba_hidden_act", "'silu'", act)
        if d.get("sliding_window") is not None:
            raise _bad("sliding_window", "null (sliding-window attention is not supported)", d["sliding_window"])
        eos = d.get("eos_token_id", 2)
        eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (eos,))
        dtype = d.get("torch_dtype", d.get("dtype", "float32")) or "float32"
        num_heads = d.get("num_attention_heads", 32)
        head_dim = d.get("head_dim")
        if head_dim is None:
            head_dim = d.get("hidden_size", 4096) // num_heads

        def get(name: str, default: Any) -> Any:
            v = d.get(name, default)
            return default if v is None and default is not None else v

        return cls(
            vocab_size=get("vocab_size", 131072),
            hidden_size=get("hidden_size", 4096),
            layer_types=layer_types,
            num_attention_heads=num_heads,
            num_key_value_heads=get("num_key_value_heads", num_heads),
            head_dim=head_dim,
            intermediate_size=get("intermediate_size", 21504),
            mlp_hidden_act=get("mlp_hidden_act", "relu2"),
            mlp_bias=bool(get("mlp_bias", False)),
            mamba_num_heads=get("mamba_num_heads", 128),
            mamba_head_dim=get("mamba_head_dim", 64),
            ssm_state_size=get("ssm_state_size", 128),
            n_groups=get("n_groups", 8),
            conv_kernel=get("conv_kernel", 4),
            chunk_size=get("chunk_size", 128),
            use_conv_bias=bool(get("use_conv_bias", True)),
            mamba_proj_bias=bool(get("use_bias", get("mamba_proj_bias", False))),
            time_step_min=float(get("time_step_min", 0.001)),
            n_routed_experts=get("n_routed_experts", 8),
            num_experts_per_tok=get("num_experts_per_tok", 2),
            moe_intermediate_size=get("moe_intermediate_size", 7688),
            moe_shared_expert_intermediate_size=get("moe_shared_expert_intermediate_size", 7688),
            moe_latent_size=d.get("moe_latent_size"),
            n_group=get("n_group", 1),
            topk_group=get("topk_group", 1),
            norm_topk_prob=bool(get("norm_topk_prob", True)),
            routed_scaling_factor=float(get("routed_scaling_factor", 1.0)),
            layer_norm_epsilon=float(get("layer_norm_epsilon", 1e-5)),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
            bos_token_id=d.get("bos_token_id"),
            pad_token_id=d.get("pad_token_id"),
            max_position_embeddings=get("max_position_embeddings", 4096),
            torch_dtype=dtype,
            mamba_ssm_cache_dtype=get("mamba_ssm_cache_dtype", "float32"),
            num_nextn_predict_layers=get("num_nextn_predict_layers", 0),
            mtp_layer_types=mtp_types,
            quantization=parse_quantization_config(d.get("quantization_config")),
            raw=d,
        )
