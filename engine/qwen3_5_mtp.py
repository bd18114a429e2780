"""The Qwen3.5 MTP (multi-token prediction) drafter: the `mtp.*` subtree of a Qwen3.5 / Qwen3.5-MoE / Qwen3-Next
checkpoint, which HF transformers does not load. Same interface as NemotronH's `mtp.MTPModule`.

Semantics, as vLLM's `Qwen3_5MultiTokenPredictor` / `Qwen3NextMultiTokenPredictor` run it:
(a) input hidden state h_i: the target's final hidden state (after `model.norm`), as for NemotronH's MTP;
(b) fusion `x = fc(cat([pre_fc_norm_embedding(embed(t_{i+1})), pre_fc_norm_hidden(h_i)], -1))`, embedding first,
    `embed` the target's (shared) table;
(c) draft step k runs decoder layer k % mtp_num_hidden_layers (a full-attention layer with the model's kind of MLP,
    two pre-norm residual blocks with the residual stream starting at the `fc` output), then the one shared
    `mtp.norm`; its output feeds the target's `lm_head` and is step k+1's hidden state.
The norms are zero-centred, folded at load as the target's are. KV (R8): the drafter's attention at position i
writes the request's slot of position i in the MTP's own KV pool layers (`with_kv_caches`), one per MTP layer.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from baton.engine.config import ModelConfig
from baton.engine.forward_batch import ForwardBatch
from baton.engine.layer_symbols import ATTENTION
from baton.engine.layers.fp8_experts import swap_fp8_experts
from baton.engine.layers.fp8_linear import bind_fp8_linears, swap_fp8_linears
from baton.engine.layers.norms import RMSNorm, pre_norm_stack
from baton.engine.ops.kernels import Kernels, bind_kernels
from baton.engine.ops.rope.reference import token_positions
from baton.engine.parallel.group import TPGroup, bind_group
from baton.engine.parallel.shard_config import shard_config
from baton.engine.parallel.shard_weights import shard_state_dict
from baton.engine.qwen3_5_model import DecoderLayer, finish_qwen_load
from baton.engine.weights import MTP_PREFIX, place


class Qwen3_5MTP(nn.Module):
    tp: TPGroup | None = None  # this rank's tensor-parallel group, set at load (`parallel.group.bind_group`)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        n = cfg.num_nextn_predict_layers
        if n < 1:
            raise ValueError(f"config field 'mtp_num_hidden_layers': expected >= 1 for an MTP module, got {n!r}")
        mixer, mlp = cfg.mtp_layer_types
        if mixer != ATTENTION:
            raise ValueError(f"qwen3_5 MTP layers: expected full attention, got {mixer!r}")
        h, eps = cfg.hidden_size, cfg.layer_norm_epsilon
        self.cfg = cfg
        self.pre_fc_norm_embedding = RMSNorm(h, eps)
        self.pre_fc_norm_hidden = RMSNorm(h, eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, mixer, mlp, i) for i in range(n))
        self.norm = RMSNorm(h, eps)
        self.num_kv_layers = n  # how many KV pool layers the drafter needs (its own, not the target's)

    def forward(self, hidden: torch.Tensor, next_token_ids: torch.Tensor, embeddings: nn.Embedding,
                batch: ForwardBatch, step: int = 0, keep: torch.Tensor | None = None) -> torch.Tensor:
        """One draft step at every token of `batch` (the arguments and result of `MTPModule.forward`)."""
        layer = self.layers[step % len(self.layers)]
        batch.positions = token_positions(batch.query_start_loc, batch.seq_lens, next_token_ids.shape[0])
        dtype = embeddings.weight.dtype  # the model's (fc's weight may be FP8)
        e = self.pre_fc_norm_embedding(embeddings(next_token_ids).to(dtype))
        x = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden.to(dtype))], dim=-1))
        return pre_norm_stack(x, layer.blocks, self.norm, batch, keep, 0, self.tp)

    @staticmethod
    def with_kv_caches(batch: ForwardBatch, mtp_kv_caches: list[torch.Tensor]) -> ForwardBatch:
        """The target's batch metadata over the drafter's KV pool layers (same blocks and slots, R8)."""
        return dataclasses.replace(batch, kv_caches=mtp_kv_caches)

    @classmethod
    def from_state_dict(cls, cfg: ModelConfig, state: dict[str, torch.Tensor], device: str | torch.device,
                        dtype: torch.dtype, kernels: Kernels, tp: TPGroup | None = None) -> Qwen3_5MTP:
        """Build from the `mtp.*` entries of a canonical checkpoint state dict, its layers running `kernels`' ops."""
        size = 1 if tp is None else tp.size
        with torch.device("meta"):
            module = cls(shard_config(cfg, size))
        if size > 1:  # this rank's shard (`parallel.shard_weights`)
            state = shard_state_dict(cfg, {k: v for k, v in state.items() if k.startswith(MTP_PREFIX)}, tp.rank, size)
        own = place({k[len(MTP_PREFIX):]: v for k, v in state.items() if k.startswith(MTP_PREFIX)}, device, dtype)
        block = None if cfg.quantization is None else cfg.quantization.block_size
        swap_fp8_linears(module, own, block)
        swap_fp8_experts(module, own, block)
        expected = set(module.state_dict())
        missing, unexpected = sorted(expected - set(own)), sorted(set(own) - expected)
        if missing or unexpected:
            raise ValueError(f"mtp weights: expected exactly the MTP module's parameters; missing "
                             f"{[MTP_PREFIX + k for k in missing[:8]]}, unexpected "
                             f"{[MTP_PREFIX + k for k in unexpected[:8]]}")
        module.load_state_dict(own, strict=True, assign=True)
        finish_qwen_load(module)
        bind_fp8_linears(module)
        bind_kernels(module, kernels)
        if size > 1:
            bind_group(module, tp)
        return module.requires_grad_(False).eval()
