"""The NemotronH MTP (multi-token prediction) drafter: one draft step = `mtp_hybrid_override_pattern` blocks.

Semantics, as the serving engines that run real NemotronH MTP checkpoints implement them:

(a) Input hidden state: the target's *final* hidden state h_i, i.e. after `norm_f` — the same tensor the
    target's `lm_head` reads. vLLM `NemotronHModel.forward` ends in `hidden_states, _ = self.norm_f(...)`
    and returns that (vllm-project/vllm `vllm/model_executor/models/nemotron_h.py`), and its spec-decode
    proposer hands the target's returned hidden states to the drafter (`vllm/v1/spec_decode/eagle.py`,
    `target_hidden_states`); TensorRT-LLM's `NemotronHModel.forward` likewise returns
    `self.norm_f(hidden_states, residual)` (NVIDIA/TensorRT-LLM `tensorrt_llm/_torch/models/modeling_nemotron_h.py`).
    Our `Backbone.forward` returns the same post-`norm_f` tensor.
(b) Fusion: `x = eh_proj(cat([enorm(embed(t_{i+1})), hnorm(h_i)], -1))` — embedding first, hidden second;
    `eh_proj` [hidden, 2*hidden], no bias (vLLM `nemotron_h_mtp.py` `NemotronHMTPAttentionDecoderLayer.forward`,
    sgl-project/sglang `python/sglang/srt/models/nemotron_h_mtp.py`, TensorRT-LLM `NemotronHMTPDecoderLayer`).
    `embed` is the target's embedding table (shared; the checkpoint has no MTP embeddings).
(c) Each MTP layer is the main model's pre-norm residual block, `x = x + mixer(norm(x))`, with the residual
    stream starting at the `eh_proj` output: all three engines run the parent NemotronH decoder layer with
    `residual=None` after the fusion (TensorRT-LLM: `residual = None  # Start fresh after fusion`; the fused
    add-RMSNorm of the next layer / of `final_layernorm` adds the residual back). `final_layernorm` sits on the
    last layer of the step, after its residual add: `out = final_layernorm(x + mixer(norm(x)))`
    (vLLM/SGLang: `hidden_states = hidden_states + residual; hidden_states = self.final_layernorm(hidden_states)`).
    The output is fed to the shared `lm_head` directly (vLLM `NemotronHMTP.compute_logits`: `lm_head` only,
    no further norm).
(d) Real checkpoints have `num_nextn_predict_layers = 1` (vLLM and SGLang assert it: "Only one MTP layer is
    supported for NemotronH-MTP") and the K draft steps reuse those same weights K times. Step k+1 gets the
    drafter's own step-k *output*, i.e. after `final_layernorm`: vLLM's proposer, for method "mtp", uses the
    model's single return value both for the logits and as the next step's `hidden_states`
    (`last_hidden_states = hidden_states = ret_hidden_states` in `vllm/v1/spec_decode/eagle.py`), and
    `NemotronHMultiTokenPredictor.forward` returns the post-`final_layernorm` tensor. (Unlike DeepSeek MTP, whose
    `shared_head.norm` is applied only on the logits path.) With n = num_nextn_predict_layers > 1 (not seen in
    real NemotronH checkpoints) draft step k uses the layers of step k % n, as vLLM's DeepSeek MTP does
    (`spec_step_idx % num_mtp_layers`).

KV cache (DESIGN R8): the drafter's attention at draft position i (inputs h_i and t_{i+1}) writes its K/V at
position i of the request's sequence, i.e. at the very slot the target's token i uses, but in the MTP's own
KV pool layers. So a `ForwardBatch` for the drafter is the target's metadata (positions, seq_lens,
block_tables, slot_mapping) with `kv_caches` replaced by the MTP pool list (`with_kv_caches`); the prefill
node runs positions 0..N-2 and a decode step appends from N-1.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from baton.engine.config import ATTENTION, MAMBA, MOE, ModelConfig
from baton.engine.config import MLP as MLP_SYMBOL
from baton.engine.forward_batch import ForwardBatch
from baton.engine.layers.attention import Attention
from baton.engine.layers.fp8_experts import swap_fp8_experts
from baton.engine.layers.fp8_linear import bind_fp8_linears, swap_fp8_linears
from baton.engine.layers.mlp import MLP
from baton.engine.layers.moe import MoE
from baton.engine.layers.norms import RMSNorm, pre_norm_stack
from baton.engine.ops.kernels import Kernels, bind_kernels
from baton.engine.parallel.group import TPGroup, bind_group
from baton.engine.parallel.shard_config import shard_config
from baton.engine.parallel.shard_weights import shard_state_dict
from baton.engine.weights import MTP_PREFIX, mtp_layout, place


class MTPLayer(nn.Module):
    """One MTP block: pre-norm residual around a mixer; fusion inputs on a step's first, final norm on its last."""

    def __init__(self, cfg: ModelConfig, symbol: str, kv_index: int | None, first: bool, last: bool) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.layer_norm_epsilon
        self.kind = symbol
        self.norm = RMSNorm(h, eps)
        if symbol == ATTENTION:
            assert kv_index is not None
            self.mixer = Attention(cfg, kv_index)
        elif symbol == MLP_SYMBOL:
            self.mixer = MLP(h, cfg.intermediate_size, cfg.mlp_hidden_act, cfg.mlp_bias)
        elif symbol == MOE:
            self.mixer = MoE(cfg)
        else:  # MTPModule validated the pattern already
            raise ValueError(f"mtp layer: expected one of *, -, E, got {symbol!r}")
        if first:
            self.enorm = RMSNorm(h, eps)
            self.hnorm = RMSNorm(h, eps)
            self.eh_proj = nn.Linear(2 * h, h, bias=False)  # in = [enorm(e); hnorm(h)]
        if last:
            self.final_layernorm = RMSNorm(h, eps)


class MTPModule(nn.Module):
    """The `mtp.*` subtree of a NemotronH checkpoint; parameter names match it under an attribute `mtp`."""

    tp: TPGroup | None = None  # this rank's tensor-parallel group, set at load (`parallel.group.bind_group`)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.num_nextn_predict_layers < 1:
            raise ValueError(f"config field 'num_nextn_predict_layers': expected >= 1 for an MTP module, "
                             f"got {cfg.num_nextn_predict_layers!r}")
        pattern = "".join(cfg.mtp_layer_types)
        if MAMBA in pattern:
            # A Mamba MTP layer would need its own recurrent state slots per draft position; not supported yet.
            raise ValueError(f"config field 'mtp_hybrid_override_pattern': expected only *, - and E "
                             f"(Mamba 'M' MTP layers are not supported yet), got {pattern!r}")
        self.cfg = cfg
        self.pattern_len = len(pattern)
        layers, kv = [], 0
        for _, symbol, first, last in mtp_layout(cfg):
            layers.append(MTPLayer(cfg, symbol, kv if symbol == ATTENTION else None, first, last))
            kv += int(symbol == ATTENTION)
        self.layers = nn.ModuleList(layers)
        self.num_kv_layers = kv  # how many KV pool layers the drafter needs (its own, not the target's)

    def forward(self, hidden: torch.Tensor, next_token_ids: torch.Tensor, embeddings: nn.Embedding,
                batch: ForwardBatch, step: int = 0, keep: torch.Tensor | None = None) -> torch.Tensor:
        """One draft step at every token of `batch`.

        hidden [T, hidden]: the target's post-`norm_f` state h_i (step 0) or this module's previous output;
        next_token_ids [T]: t_{i+1}; embeddings: the target's (shared) table; batch: the target's metadata for
        positions i with `kv_caches` = the MTP's pool layers. Returns [T, hidden], after `final_layernorm`: the
        input of the shared `lm_head` and the `hidden` of the next draft step. keep (token indices, on the
        device): only those tokens' outputs [len(keep), hidden]; the layers past the step's last attention layer
        run on them alone (`pre_norm_stack`), its KV is written for every token.
        """
        n = self.pattern_len
        j0 = (step % self.cfg.num_nextn_predict_layers) * n
        layers = self.layers[j0:j0 + n]
        first = layers[0]
        dtype = embeddings.weight.dtype  # the model's (eh_proj's weight may be FP8)
        e = embeddings(next_token_ids).to(dtype)  # [T, hidden]
        h = first.eh_proj(torch.cat([first.enorm(e), first.hnorm(hidden.to(dtype))], dim=-1))  # [T, hidden]
        keep_from = max((i for i, layer in enumerate(layers) if layer.kind == ATTENTION), default=None)
        return pre_norm_stack(h, layers, layers[-1].final_layernorm, batch, keep, keep_from, self.tp)

    @staticmethod
    def with_kv_caches(batch: ForwardBatch, mtp_kv_caches: list[torch.Tensor]) -> ForwardBatch:
        """The target's batch metadata over the drafter's KV pool layers (same blocks and slots, R8)."""
        return dataclasses.replace(batch, kv_caches=mtp_kv_caches)

    @staticmethod
    def mtp_entries(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`mtp.layers.0.norm.weight` -> `layers.0.norm.weight`; everything not under `mtp.` is dropped."""
        return {k[len(MTP_PREFIX):]: v for k, v in state.items() if k.startswith(MTP_PREFIX)}

    def load(self, state: dict[str, torch.Tensor]) -> None:
        """Copy the `mtp.*` entries of a checkpoint state dict in place; exactly our parameters, else ValueError."""
        own = self.mtp_entries(state)
        self._check_keys(own)
        self.load_state_dict(own, strict=True)

    def _check_keys(self, own: dict[str, torch.Tensor]) -> None:
        expected = set(self.state_dict())
        missing, unexpected = sorted(expected - set(own)), sorted(set(own) - expected)
        if missing or unexpected:
            raise ValueError(f"mtp weights: expected exactly the MTP module's parameters; missing "
                             f"{[MTP_PREFIX + k for k in missing[:8]]}, unexpected "
                             f"{[MTP_PREFIX + k for k in unexpected[:8]]}")

    @classmethod
    def from_state_dict(cls, cfg: ModelConfig, state: dict[str, torch.Tensor], device: str | torch.device,
                        dtype: torch.dtype, kernels: Kernels, tp: TPGroup | None = None) -> MTPModule:
        """Build from the `mtp.*` entries of a (canonical) checkpoint state dict (other entries are ignored), its
        layers running `kernels`' ops."""
        size = 1 if tp is None else tp.size
        with torch.device("meta"):
            module = cls(shard_config(cfg, size))
        if size > 1:  # this rank's shard (`parallel.shard_weights`)
            state = shard_state_dict(cfg, {k: v for k, v in state.items() if k.startswith(MTP_PREFIX)}, tp.rank, size)
        own = place(cls.mtp_entries(state), device, dtype)
        block = None if cfg.quantization is None else cfg.quantization.block_size
        swap_fp8_linears(module, own, block)
        swap_fp8_experts(module, own, block)
        module._check_keys(own)
        module.load_state_dict(own, strict=True, assign=True)
        for m in module.modules():
            if isinstance(m, Attention):
                m.fuse_qkv()
        bind_fp8_linears(module)
        bind_kernels(module, kernels)
        if size > 1:
            bind_group(module, tp)
        return module.requires_grad_(False).eval()
