"""The Qwen3.5 causal LM (text; dense, MoE, and Qwen3-Next, which shares its layers) over varlen batches, a
`CausalLM`. Parameter names mirror HF transformers'
`Qwen3_5ForCausalLM` (`model.layers.{i}.linear_attn.*` / `.self_attn.*`, `.mlp.*`), so a canonical state dict
(`weights_qwen3_5`) loads as is.

Each decoder layer is two pre-norm residual blocks for `pre_norm_stack`: (input_layernorm, token mixer) and
(post_attention_layernorm, gated MLP or sparse MoE block). Qwen3.5's RMSNorms are zero-centred (out = norm(x) * (1 + w)): `finish_load`
folds the 1 into their weights, kept in fp32 so that the sum is exactly HF's `1.0 + w.float()`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from baton.engine.causal_lm import CausalLM
from baton.engine.config import ModelConfig
from baton.engine.forward_batch import ForwardBatch
from baton.engine.layer_symbols import ATTENTION, GDN, MOE
from baton.engine.layers.gated_attention import GatedAttention
from baton.engine.layers.gated_deltanet import GatedDeltaNetMixer
from baton.engine.layers.gated_mlp import GatedMLP
from baton.engine.layers.norms import RMSNorm, pre_norm_stack
from baton.engine.layers.qwen_moe import QwenSparseMoE
from baton.engine.ops.rope.reference import token_positions
from baton.engine.parallel.group import TPGroup


@dataclass(frozen=True)
class _Block:
    """One residual branch as `pre_norm_stack` runs it (the modules are registered by their decoder layer)."""

    norm: nn.Module
    mixer: nn.Module


class DecoderLayer(nn.Module):
    """A token mixer (`mixer` G or *, owning state-pool layer / KV-pool layer `index`) and an MLP (`mlp` - or E)."""

    def __init__(self, cfg: ModelConfig, mixer: str, mlp: str, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        if mixer == GDN:
            self.linear_attn = GatedDeltaNetMixer(cfg, index)
            token_mixer: nn.Module = self.linear_attn
        elif mixer == ATTENTION:
            self.self_attn = GatedAttention(cfg, index)
            token_mixer = self.self_attn
        else:
            raise ValueError(f"qwen3_5 decoder layer: expected a G or * token mixer, got {mixer!r}")
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        self.mlp = QwenSparseMoE(cfg) if mlp == MOE else GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.blocks = (_Block(self.input_layernorm, token_mixer), _Block(self.post_attention_layernorm, self.mlp))


def decoder_layer(cfg: ModelConfig, layer_id: int) -> DecoderLayer:
    """Decoder layer `layer_id` of the target model: blocks 2 * layer_id (its mixer) and the next (its MLP)."""
    block = 2 * layer_id
    mixer = cfg.layer_types[block]
    ids = cfg.recurrent_layer_ids if mixer == GDN else cfg.attention_layer_ids
    return DecoderLayer(cfg, mixer, cfg.layer_types[block + 1], ids.index(block) if block in ids else -1)


# The canonical weights of the RMSNorms `finish_qwen_load` folds (the final norms `model.norm`, `mtp.norm` apart).
RMSNORM_WEIGHTS = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight",
                   "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")


def finish_qwen_load(root: nn.Module) -> None:
    """What the loaded weights fix once: norm(x) * (1 + w) as an RMSNorm of weight 1 + w, in fp32 (exactly HF's
    `1.0 + w.float()`), RoPE's constants on the weights' device, and the projections that read one input fused
    (`fused_linears`)."""
    for module in root.modules():
        if isinstance(module, RMSNorm):
            module.weight = nn.Parameter(1.0 + module.weight.detach().float(), requires_grad=False)
        elif isinstance(module, GatedAttention):
            module.place_rope()
            module.fuse()
        elif isinstance(module, GatedDeltaNetMixer | GatedMLP):
            module.fuse()


class TextModel(nn.Module):
    tp: TPGroup | None = None  # this rank's tensor-parallel group, set at load (`parallel.group.bind_group`)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(decoder_layer(cfg, i) for i in range(cfg.num_layers // 2))
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        self.blocks = [b for layer in self.layers for b in layer.blocks]
        # The last block that writes a cache: past its mixer a token's hidden state reaches only its own output.
        self.last_cache_layer = max((i for i, k in enumerate(cfg.layer_types) if k in (GDN, ATTENTION)), default=None)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, keep: torch.Tensor | None = None
                ) -> torch.Tensor:
        batch.positions = token_positions(batch.query_start_loc, batch.seq_lens, input_ids.shape[0])
        return pre_norm_stack(self.embed_tokens(input_ids), self.blocks, self.norm, batch, keep,
                              self.last_cache_layer, self.tp)


class Qwen3_5ForCausalLM(CausalLM):
    recurrent_mixer = GatedDeltaNetMixer

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.model = TextModel(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, keep: torch.Tensor | None = None
                ) -> torch.Tensor:
        return self.model(input_ids, batch, keep)

    def output_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def finish_load(self) -> None:
        finish_qwen_load(self)

    @classmethod
    def runs_in_fp32(cls, name: str) -> bool:
        """The RMSNorms' weights too: `finish_qwen_load` holds 1 + w in fp32."""
        return super().runs_in_fp32(name) or name.endswith(RMSNORM_WEIGHTS) or name in ("model.norm.weight",
                                                                                            "mtp.norm.weight")
