"""Rank r's shard of a canonical checkpoint state dict (NemotronH and Qwen3.5 names), for the shapes of
`shard_config`.

Column-parallel weights (a layer's first projections) keep the rank's output rows, row-parallel ones (out_proj,
o_proj, down_proj) its input columns; a fused projection (Mamba2's in_proj z|x|B|C|dt, the Gated DeltaNet's q|k|v)
is split segment by segment, each segment per head or group, and the depthwise conv's channels follow their
segments. A row-parallel bias is kept on rank 0 only (zeros elsewhere), since the block's all-reduce sums every
rank's output. Everything else (norms, routers, the MTP fusion projection) is replicated.

Invariant: every rank's shards, concatenated per segment in rank order, are the checkpoint's tensor (KV heads
replicated when fewer than ranks: rank r holds head r * Hkv // tp).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from baton.engine.config import ModelConfig
from baton.engine.parallel.vocab import shard_rows

VOCAB_NAMES = ("model.embeddings.weight", "model.embed_tokens.weight", "lm_head.weight")


def _segments(t: torch.Tensor, dim: int, sizes: list[int], rank: int, tp: int) -> torch.Tensor:
    """The rank's contiguous share of each segment (`sizes` along `dim`), concatenated."""
    if sum(sizes) != t.shape[dim]:
        raise ValueError(f"tensor parallel shard: expected {sum(sizes)} channels along dim {dim}, got "
                         f"{t.shape[dim]} (shape {tuple(t.shape)})")
    parts = []
    for seg in t.split(sizes, dim=dim):
        if seg.shape[dim] % tp:
            raise ValueError(f"tensor parallel shard: expected segments of a multiple of {tp} channels along dim "
                             f"{dim}, got {sizes} (shape {tuple(t.shape)})")
        n = seg.shape[dim] // tp
        parts.append(seg.narrow(dim, rank * n, n))
    return torch.cat(parts, dim=dim)


def _kv_rows(t: torch.Tensor, num_kv: int, head_dim: int, rank: int, tp: int) -> torch.Tensor:
    if num_kv >= tp:
        return _segments(t, 0, [num_kv * head_dim], rank, tp)
    head = rank * num_kv // tp  # the KV head this rank's query heads read
    return t[head * head_dim:(head + 1) * head_dim]


Rule = Callable[[torch.Tensor, ModelConfig, int, int], torch.Tensor]  # (tensor, full config, rank, tp) -> shard


def _rows(t: torch.Tensor, cfg: ModelConfig, rank: int, tp: int) -> torch.Tensor:
    """Column-parallel: the rank's output rows (per head, channel or group: contiguous shares)."""
    return _segments(t, 0, [t.shape[0]], rank, tp)


def _cols(t: torch.Tensor, cfg: ModelConfig, rank: int, tp: int) -> torch.Tensor:
    """Row-parallel: the rank's input columns (the last dim; an expert stack's too)."""
    return _segments(t, t.dim() - 1, [t.shape[-1]], rank, tp)


def _rank0(t: torch.Tensor, cfg: ModelConfig, rank: int, tp: int) -> torch.Tensor:
    """A row-parallel bias: added once, by rank 0, to the sum of the ranks' outputs."""
    return t if rank == 0 else torch.zeros_like(t)


def _kv(t: torch.Tensor, cfg: ModelConfig, rank: int, tp: int) -> torch.Tensor:
    return _kv_rows(t, cfg.num_key_value_heads, cfg.head_dim, rank, tp)


def _mamba_in_proj(t: torch.Tensor, cfg: ModelConfig, rank: int, tp: int) -> torch.Tensor:
    i, gn = cfg.mamba_intermediate_size, cfg.n_groups * cfg.ssm_state_size
    return _segments(t, 0, [i, i, gn, gn, cfg.mamba_num_heads], rank, tp)  # z | x | B | C | dt


def _mamba_conv(t: torch.Tensor, cfg: ModelConfig, rank: int, tp: int) -> torch.Tensor:
    gn = cfg.n_groups * cfg.ssm_state_size
    return _segments(t, 0, [cfg.mamba_intermediate_size, gn, gn], rank, tp)  # x | B | C


def _gdn_qkv(t: torch.Tensor, cfg: ModelConfig, rank: int, tp: int) -> torch.Tensor:
    # Value head j reads key head j // (Hv / Hk): contiguous shares of both keep each pair on one rank.
    kd = cfg.gdn_key_dim
    return _segments(t, 0, [kd, kd, cfg.gdn_value_dim], rank, tp)  # q | k | v


def _expert_rows(t: torch.Tensor, cfg: ModelConfig, rank: int, tp: int) -> torch.Tensor:
    return _segments(t, 1, [t.shape[1]], rank, tp)  # [E, I, d]


def _expert_gate_up(t: torch.Tensor, cfg: ModelConfig, rank: int, tp: int) -> torch.Tensor:
    return _segments(t, 1, [t.shape[1] // 2] * 2, rank, tp)  # [E, 2I, H]: each expert's gate rows, then its up rows


# The name after the block's module (`mixer.` NemotronH; `self_attn.`, `linear_attn.`, `mlp.` Qwen3.5) -> its rule;
# a name not listed is replicated.
RULES: dict[str, Rule] = {
    # NemotronH attention and Qwen3.5 gated attention (q_proj: each head's queries, then its gate)
    "mixer.q_proj.weight": _rows, "mixer.k_proj.weight": _kv, "mixer.v_proj.weight": _kv, "mixer.o_proj.weight": _cols,
    "self_attn.q_proj.weight": _rows, "self_attn.k_proj.weight": _kv, "self_attn.v_proj.weight": _kv,
    "self_attn.o_proj.weight": _cols,
    # Mamba2
    "mixer.in_proj.weight": _mamba_in_proj, "mixer.in_proj.bias": _mamba_in_proj,
    "mixer.conv1d.weight": _mamba_conv, "mixer.conv1d.bias": _mamba_conv,
    "mixer.dt_bias": _rows, "mixer.A_log": _rows, "mixer.D": _rows, "mixer.norm.weight": _rows,
    "mixer.out_proj.weight": _cols, "mixer.out_proj.bias": _rank0,
    # NemotronH MLP and MoE (experts [E, I, d] / [E, d, I])
    "mixer.up_proj.weight": _rows, "mixer.up_proj.bias": _rows, "mixer.down_proj.weight": _cols,
    "mixer.down_proj.bias": _rank0,
    "mixer.experts.up_proj": _expert_rows, "mixer.experts.down_proj": _cols,
    "mixer.shared_experts.up_proj.weight": _rows, "mixer.shared_experts.up_proj.bias": _rows,
    "mixer.shared_experts.down_proj.weight": _cols, "mixer.shared_experts.down_proj.bias": _rank0,
    # The latent projection back to hidden is linear, so it maps the ranks' partial sums (its bias once).
    "mixer.fc2_latent_proj.bias": _rank0,
    # Gated DeltaNet
    "linear_attn.in_proj_qkv.weight": _gdn_qkv, "linear_attn.conv1d.weight": _gdn_qkv,
    "linear_attn.in_proj_z.weight": _rows, "linear_attn.in_proj_a.weight": _rows, "linear_attn.in_proj_b.weight": _rows,
    "linear_attn.dt_bias": _rows, "linear_attn.A_log": _rows, "linear_attn.out_proj.weight": _cols,
    # Qwen3.5 gated MLP and sparse MoE
    "mlp.gate_proj.weight": _rows, "mlp.up_proj.weight": _rows, "mlp.down_proj.weight": _cols,
    "mlp.experts.gate_up_proj": _expert_gate_up, "mlp.experts.down_proj": _cols,
    "mlp.shared_expert.gate_proj.weight": _rows, "mlp.shared_expert.up_proj.weight": _rows,
    "mlp.shared_expert.down_proj.weight": _cols,
}
BLOCK_MODULES = (".mixer.", ".self_attn.", ".linear_attn.", ".mlp.")


def _shard(cfg: ModelConfig, name: str, t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    if name in VOCAB_NAMES:
        return shard_rows(t, rank, tp)
    sep = next((s for s in BLOCK_MODULES if s in name), None)
    rule = None if sep is None else RULES.get(sep[1:] + name.split(sep, 1)[1])
    return t if rule is None else rule(t, cfg, rank, tp)


def shard_state_dict(cfg: ModelConfig, state: Mapping[str, torch.Tensor], rank: int, tp: int
                     ) -> dict[str, torch.Tensor]:
    """Rank `rank`'s tensors of the canonical state dict of `cfg` (the full model's config), for `tp` ranks."""
    if tp == 1:
        return dict(state)
    return {name: _shard(cfg, name, t, rank, tp).contiguous() for name, t in state.items()}
