"""Rank r's shard of a canonical checkpoint state dict (NemotronH and Qwen3.5 names), for the shapes of
`shard_config`.

Column-parallel weights (a layer's first projections) keep the rank's output rows, row-parallel ones (out_proj,
o_proj, down_proj) its input columns; a fused projection (Mamba2's in_proj z|x|B|C|dt, the Gated DeltaNet's q|k|v)
is split segment by segment, each segment per head or group, and the depthwise conv's channels follow their
segments. A row-parallel bias is kept on rank 0 only (zeros elsewhere), since the block's all-reduce sums every
rank's output. Everything else (norms, routers, the MTP fusion projection) is replicated.

FP8 weights shard as their 16-bit twins do, routed-expert stacks included. A per-tensor scale (and a static input
scale; an expert stack's `[E]` / `[E, 2]` scales) is replicated; a block scale (`weight_scale_inv`, an expert
stack's `P_scale_inv`, one per `weight_block_size` block; a gated stack's gate and up rows each with their own grid)
keeps the checkpoint block of each of the rank's blocks, which exists only where each rank block's channels lie in
one checkpoint block: a split that cuts a checkpoint block between two of a rank's blocks is refused naming the
weight (the rank's values would need requantizing, which would make TP > 1 compute something else than TP = 1).

Invariant: every rank's shards, concatenated per segment in rank order, are the checkpoint's tensor (KV heads
replicated when fewer than ranks: rank r holds head r * Hkv // tp).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from baton.engine.config import ModelConfig
from baton.engine.parallel.vocab import shard_rows
from baton.engine.quant_config import STACK_SCALE_INV

VOCAB_NAMES = ("model.embeddings.weight", "model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class Take:
    """The channels a rank holds of a tensor: the `(start, length)` ranges along `dim`, concatenated in order."""

    dim: int
    ranges: tuple[tuple[int, int], ...]

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        parts = [t.narrow(self.dim, start, n) for start, n in self.ranges]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)

    def index(self) -> torch.Tensor:
        """The checkpoint channel of each of the rank's channels."""
        return torch.cat([torch.arange(start, start + n) for start, n in self.ranges])


def _segments(shape: torch.Size, dim: int, sizes: list[int], rank: int, tp: int) -> Take:
    """The rank's contiguous share of each segment (`sizes` along `dim`), concatenated."""
    if sum(sizes) != shape[dim]:
        raise ValueError(f"tensor parallel shard: expected {sum(sizes)} channels along dim {dim}, got "
                         f"{shape[dim]} (shape {tuple(shape)})")
    ranges, offset = [], 0
    for size in sizes:
        if size % tp:
            raise ValueError(f"tensor parallel shard: expected segments of a multiple of {tp} channels along dim "
                             f"{dim}, got {sizes} (shape {tuple(shape)})")
        n = size // tp
        ranges.append((offset + rank * n, n))
        offset += size
    return Take(dim, tuple(ranges))


def _kv_rows(shape: torch.Size, num_kv: int, head_dim: int, rank: int, tp: int) -> Take:
    if num_kv >= tp:
        return _segments(shape, 0, [num_kv * head_dim], rank, tp)
    head = rank * num_kv // tp  # the KV head this rank's query heads read
    return Take(0, ((head * head_dim, head_dim),))


Rule = Callable[[torch.Size, ModelConfig, int, int], Take]  # (tensor shape, full config, rank, tp) -> its shard


def _rows(shape: torch.Size, cfg: ModelConfig, rank: int, tp: int) -> Take:
    """Column-parallel: the rank's output rows (per head, channel or group: contiguous shares)."""
    return _segments(shape, 0, [shape[0]], rank, tp)


def _cols(shape: torch.Size, cfg: ModelConfig, rank: int, tp: int) -> Take:
    """Row-parallel: the rank's input columns (the last dim; an expert stack's too)."""
    return _segments(shape, len(shape) - 1, [shape[-1]], rank, tp)


def _kv(shape: torch.Size, cfg: ModelConfig, rank: int, tp: int) -> Take:
    return _kv_rows(shape, cfg.num_key_value_heads, cfg.head_dim, rank, tp)


def _mamba_in_proj(shape: torch.Size, cfg: ModelConfig, rank: int, tp: int) -> Take:
    i, gn = cfg.mamba_intermediate_size, cfg.n_groups * cfg.ssm_state_size
    return _segments(shape, 0, [i, i, gn, gn, cfg.mamba_num_heads], rank, tp)  # z | x | B | C | dt


def _mamba_conv(shape: torch.Size, cfg: ModelConfig, rank: int, tp: int) -> Take:
    gn = cfg.n_groups * cfg.ssm_state_size
    return _segments(shape, 0, [cfg.mamba_intermediate_size, gn, gn], rank, tp)  # x | B | C


def _gdn_qkv(shape: torch.Size, cfg: ModelConfig, rank: int, tp: int) -> Take:
    # Value head j reads key head j // (Hv / Hk): contiguous shares of both keep each pair on one rank.
    kd = cfg.gdn_key_dim
    return _segments(shape, 0, [kd, kd, cfg.gdn_value_dim], rank, tp)  # q | k | v


def _expert_rows(shape: torch.Size, cfg: ModelConfig, rank: int, tp: int) -> Take:
    return _segments(shape, 1, [shape[1]], rank, tp)  # [E, I, d]


def _expert_gate_up(shape: torch.Size, cfg: ModelConfig, rank: int, tp: int) -> Take:
    return _segments(shape, 1, [shape[1] // 2] * 2, rank, tp)  # [E, 2I, H]: each expert's gate rows, then its up rows


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
    "mixer.out_proj.weight": _cols,
    # NemotronH MLP and MoE (experts [E, I, d] / [E, d, I])
    "mixer.up_proj.weight": _rows, "mixer.up_proj.bias": _rows, "mixer.down_proj.weight": _cols,
    "mixer.experts.up_proj": _expert_rows, "mixer.experts.down_proj": _cols,
    "mixer.shared_experts.up_proj.weight": _rows, "mixer.shared_experts.up_proj.bias": _rows,
    "mixer.shared_experts.down_proj.weight": _cols,
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
# Row-parallel biases: added once, by rank 0, to the sum of the ranks' outputs. The latent projection back to hidden
# is linear, so it maps the ranks' partial sums and its bias is one of them.
RANK0_BIASES = ("mixer.out_proj.bias", "mixer.down_proj.bias", "mixer.shared_experts.down_proj.bias",
                "mixer.fc2_latent_proj.bias")
BLOCK_MODULES = (".mixer.", ".self_attn.", ".linear_attn.", ".mlp.")


def _block_ids(index: torch.Tensor, size: int, parts: int, b: int) -> torch.Tensor:
    """The scale grid's block of each channel `index` of a dim of `size` channels in `parts` equal segments, each
    segment with its own grid (a gated expert stack's gate rows, then its up rows: `ops.moe.reference`)."""
    seg = size // parts
    return (index // seg) * -(-seg // b) + (index % seg) // b


def _block_scale(weight_name: str, take: Take, scale: torch.Tensor, block: tuple[int, int], size: int,
                 parts: int) -> torch.Tensor:
    """The rank's rows (or columns) of a block scale grid (an expert stack's: [E, rows, columns]): each of its
    blocks' checkpoint block, which must be one. `size`: the weight's channels along the cut dim; `parts`: its
    segments with their own grids."""
    columns = take.dim == scale.dim() - 1
    b = block[1] if columns else block[0]
    index = take.index()
    mine = _block_ids(torch.arange(len(index)), len(index), parts, b)  # the rank's block of each of its channels
    theirs = _block_ids(index, size, parts, b)  # the checkpoint's
    first = []
    for j in range(int(mine.max()) + 1):
        rows = (mine == j).nonzero().flatten()
        chunk = theirs[rows]
        if bool((chunk != chunk[0]).any()):
            what = "columns" if columns else "rows"
            raise ValueError(f"tensor parallel shard of block-scaled FP8 '{weight_name}': expected each {b} {what} "
                             f"of a rank's shard to lie in one checkpoint block (weight_block_size {list(block)}), "
                             f"got its {what} {int(rows[0])}..{int(rows[-1])} from checkpoint blocks "
                             f"{sorted(set(chunk.tolist()))}; a tensor_parallel_size whose shards are whole blocks "
                             f"loads it")
        first.append(int(chunk[0]))
    return scale.index_select(take.dim, torch.tensor(first))


def _shard(cfg: ModelConfig, state: Mapping[str, torch.Tensor], name: str, t: torch.Tensor, rank: int,
           tp: int) -> torch.Tensor:
    if name in VOCAB_NAMES:
        return shard_rows(t, rank, tp)
    sep = next((s for s in BLOCK_MODULES if s in name), None)
    if sep is None:
        return t
    key = sep[1:] + name.split(sep, 1)[1]
    if key in RANK0_BIASES:
        return t if rank == 0 else torch.zeros_like(t)
    rule = RULES.get(key)
    if rule is not None:
        return rule(t.shape, cfg, rank, tp).apply(t)
    # `P.weight_scale_inv` is `P.weight`'s block scale, an expert stack's `P_scale_inv` stack `P`'s
    weight_name = name[:-len(STACK_SCALE_INV)]
    rule = RULES.get(key[:-len(STACK_SCALE_INV)]) if name.endswith(STACK_SCALE_INV) else None
    if rule is None or weight_name not in state:
        return t  # replicated (a per-tensor or input scale among them)
    if cfg.quantization is None or cfg.quantization.block_size is None:
        raise ValueError(f"tensor parallel shard: '{name}' is a block scale, expected a quantization_config with "
                         f"weight_block_size, got {cfg.quantization!r}")
    shape = state[weight_name].shape
    take = rule(shape, cfg, rank, tp)
    parts = 2 if rule is _expert_gate_up and take.dim == 1 else 1
    return _block_scale(weight_name, take, t, cfg.quantization.block_size, shape[take.dim], parts)


def shard_state_dict(cfg: ModelConfig, state: Mapping[str, torch.Tensor], rank: int, tp: int
                     ) -> dict[str, torch.Tensor]:
    """Rank `rank`'s tensors of the canonical state dict of `cfg` (the full model's config), for `tp` ranks."""
    if tp == 1:
        return dict(state)
    return {name: _shard(cfg, state, name, t, rank, tp).contiguous() for name, t in state.items()}
