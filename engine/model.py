"""The NemotronH hybrid causal LM over varlen batches (a `CausalLM`). Parameter names mirror HF transformers'
`NemotronHForCausalLM` (`model.layers.{i}.mixer.*`), so a checkpoint's state dict loads as is.
"""

from __future__ import annotations

import torch
from torch import nn

from baton.engine.causal_lm import CausalLM
from baton.engine.config import ATTENTION, MAMBA, MOE, ModelConfig
from baton.engine.config import MLP as MLP_SYMBOL
from baton.engine.forward_batch import ForwardBatch
from baton.engine.layers.attention import Attention
from baton.engine.layers.mamba2 import Mamba2Mixer
from baton.engine.layers.mlp import MLP
from baton.engine.layers.moe import MoE
from baton.engine.layers.norms import RMSNorm, pre_norm_stack
from baton.engine.parallel.group import TPGroup


class Block(nn.Module):
    """Pre-norm residual block around one mixer (Mamba2, attention, MLP or MoE): h + mixer(norm(h)), run by
    `pre_norm_stack` with the residual add fused into the next block's norm (or the final one)."""

    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        kind = cfg.layer_types[layer_id]
        self.kind = kind
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        if kind == MAMBA:
            self.mixer = Mamba2Mixer(cfg, cfg.mamba_layer_ids.index(layer_id))
        elif kind == ATTENTION:
            self.mixer = Attention(cfg, cfg.attention_layer_ids.index(layer_id))
        elif kind == MLP_SYMBOL:
            self.mixer = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_hidden_act, cfg.mlp_bias)
        elif kind == MOE:
            self.mixer = MoE(cfg)
        else:
            raise ValueError(f"layer {layer_id}: expected one of M, *, -, E, got {kind!r}")


class Backbone(nn.Module):
    tp: TPGroup | None = None  # this rank's tensor-parallel group, set at load (`parallel.group.bind_group`)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        # The last layer that writes a cache (attention's KV, Mamba's state): past its mixer a token's hidden
        # state reaches only its own output (`pre_norm_stack`'s keep).
        self.last_cache_layer = max((i for i, k in enumerate(cfg.layer_types) if k in (MAMBA, ATTENTION)),
                                    default=None)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, keep: torch.Tensor | None = None
                ) -> torch.Tensor:
        return pre_norm_stack(self.embeddings(input_ids), self.layers, self.norm_f, batch, keep,
                              self.last_cache_layer, self.tp)


class NemotronHForCausalLM(CausalLM):
    recurrent_mixer = Mamba2Mixer  # the mixer of its MAMBA layers

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.model = Backbone(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, keep: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Final hidden states of every token [T, hidden], or of the tokens `keep` lists [len(keep), hidden] (the
        layers past the last cache-writing one then run on those alone: `pre_norm_stack`). The caches are
        written either way."""
        return self.model(input_ids, batch, keep)

    def output_weight(self) -> torch.Tensor:
        return self.model.embeddings.weight if self.lm_head is None else self.lm_head.weight

    def input_embeddings(self) -> nn.Embedding:
        return self.model.embeddings

    def finish_load(self) -> None:
        for module in self.modules():
            if isinstance(module, Mamba2Mixer):
                module.freeze()
            elif isinstance(module, Attention):
                module.fuse_qkv()
