"""What every model family's causal LM shares: its recurrent mixer's declared state, the logits, loading a
canonical state dict. A family is one subclass in its own file (`model.py` NemotronH, `qwen3_5_model.py`
Qwen3.5), picked by `model_family.model_class`.

Invariants: `forward(input_ids, batch, keep)` returns final-norm hidden states and writes every cache layer;
the state pools hold `recurrent_mixer`'s declared state for each of `cfg.recurrent_layer_ids`, in order. Under
tensor parallelism (`from_state_dict`'s `tp`) `cfg` is this rank's shard's (`parallel.shard_config`: its heads and
channels, the full vocabulary), the hidden states are whole on every rank and so are the logits (gathered).
"""

from __future__ import annotations

from abc import abstractmethod

import torch
from torch import nn

from baton.engine.config import ModelConfig
from baton.engine.forward_batch import ForwardBatch
from baton.engine.layers.fp8_experts import swap_fp8_experts
from baton.engine.layers.fp8_linear import bind_fp8_linears, swap_fp8_linears
from baton.engine.layers.recurrent_mixer import RecurrentMixer
from baton.engine.ops.kernels import Kernels, bind_kernels
from baton.engine.parallel.group import TPGroup, bind_group
from baton.engine.parallel.shard_config import shard_config
from baton.engine.parallel.shard_weights import shard_state_dict
from baton.engine.parallel.vocab import swap_vocab_parallel
from baton.engine.state_spec import StateSpec
from baton.engine.weights import FP32_SUFFIXES, MTP_PREFIX, place


class CausalLM(nn.Module):
    recurrent_mixer: type[RecurrentMixer]  # the mixer whose declared state the state pools hold
    # This engine's implementation of each op, set once at load (`ops.kernels.bind_kernels`); the runners and
    # graphs read it here.
    kernels: Kernels | None = None
    tp: TPGroup | None = None  # this rank's tensor-parallel group, set at load (`parallel.group.bind_group`)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg

    @classmethod
    def state_spec(cls, cfg: ModelConfig) -> StateSpec:
        """What the state pools hold per slot (`cache_pools.plan_cache`)."""
        return cls.recurrent_mixer.state_spec(cfg, len(cfg.recurrent_layer_ids))

    @classmethod
    def runs_in_fp32(cls, name: str) -> bool:
        """Whether canonical weight `name` is held in fp32 whatever the model dtype once loaded: the loader's
        (`FP32_SUFFIXES`), and what a family's `finish_load` makes fp32."""
        return name.endswith(FP32_SUFFIXES)

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, keep: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Final hidden states of every token [T, hidden], or of the tokens `keep` lists [len(keep), hidden]. The
        caches are written either way."""

    @abstractmethod
    def output_weight(self) -> torch.Tensor:
        """The [vocab, hidden] weight of the logits: lm_head's, or the tied embeddings'."""

    @abstractmethod
    def input_embeddings(self) -> nn.Embedding:
        """The token embedding table (the MTP drafter shares it)."""

    def finish_load(self) -> None:
        """Derive what the layers compute once from the loaded weights (fused projections, constants)."""

    def logits(self, hidden: torch.Tensor, fused: bool = False, upcast: bool = True) -> torch.Tensor:
        """[T, vocab], float32 unless `upcast` is False (then the weights' dtype: the samplers take the argmax of
        those values, which a float32 copy would not change, and upcast only the rows they draw from, because
        a float32 copy of a large batch's logits is a noticeable part of a decode step). `fused` (a step of
        `ForwardBatch.fused_gemv`) reads the weight with the GEMV kernel, which beat cuBLAS on this shape at one
        row (`benchmarks/gemv_bench.py`)."""
        weight = self.output_weight()
        if fused:
            out = self.kernels.fused_linear(hidden, weight)
        else:
            out = torch.nn.functional.linear(hidden, weight)
        if self.tp is not None and self.tp.size > 1:
            # This rank's vocabulary columns -> all of them, in rank order, without the last rank's padding.
            out = self.tp.all_gather(out)
            if out.shape[-1] != self.cfg.vocab_size:
                out = out[..., :self.cfg.vocab_size].contiguous()
        return out.float() if upcast else out

    @classmethod
    def from_state_dict(cls, cfg: ModelConfig, state: dict[str, torch.Tensor], device: str | torch.device,
                        dtype: torch.dtype, kernels: Kernels, tp: TPGroup | None = None) -> CausalLM:
        """The model of a (canonical) checkpoint state dict, its layers running `kernels`' ops; with `tp`, this
        rank's shard of it (ValueError naming the config field that cannot be split)."""
        size = 1 if tp is None else tp.size
        local = shard_config(cfg, size)
        with torch.device("meta"):
            model = cls(local)
            if size > 1:
                swap_vocab_parallel(model, cfg.vocab_size, tp)
        target = {k: v for k, v in state.items() if not k.startswith(MTP_PREFIX)}
        if size > 1:
            target = shard_state_dict(cfg, target, tp.rank, size)
        target = place(target, device, dtype)
        quant = cfg.quantization
        swap_fp8_linears(model, target, None if quant is None else quant.block_size)
        swap_fp8_experts(model, target, None if quant is None else quant.block_size)
        missing, unexpected = model.load_state_dict(target, strict=False, assign=True)
        if missing or unexpected:
            raise ValueError(f"checkpoint weights: expected exactly the model's parameters; missing "
                             f"{sorted(missing)[:8]}, unexpected {sorted(unexpected)[:8]}")
        model.finish_load()
        bind_fp8_linears(model)
        bind_kernels(model, kernels)
        if size > 1:
            bind_group(model, tp)
        return model.requires_grad_(False).eval()
