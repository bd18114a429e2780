"""NemotronH MoE: sigmoid top-k router with group selection, non-gated experts, one shared expert.

The routing math and the routed experts live in `ops.moe` (this engine's `moe_route_sigmoid` and `moe_experts`: the
torch references on CPU, the routing kernel and the fused-MoE kernels on CUDA); the shared expert and the latent
projections stay ordinary linears (FP8Linears where the checkpoint stores them in FP8), the shared expert's read by
the GEMV kernel in few-token steps as the step's other linears. The routed experts of an FP8
checkpoint stay FP8 with their scales (`layers.fp8_experts`), which both paths take."""

from __future__ import annotations

import torch
from torch import nn

from baton.engine.config import ModelConfig
from baton.engine.layers.fp8_experts import ExpertStacks
from baton.engine.layers.mlp import MLP, activation
from baton.engine.ops.kernels import Kernels


class TopkRouter(nn.Module):
    # This engine's implementation of each op, set once at load (`ops.kernels.bind_kernels`).
    kernels: Kernels | None = None

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # The router stays fp32 whatever the model dtype (as the reference keeps it).
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        logits = torch.nn.functional.linear(x.float(), self.weight.float())  # [T, E]
        return self.kernels.moe_route_sigmoid(logits, self.e_score_correction_bias, cfg.n_group, cfg.topk_group,
                                              cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.routed_scaling_factor)


class Experts(ExpertStacks):
    STACKS = (("up_proj", 1), ("down_proj", 1))
    # This engine's implementation of each op, set once at load (`ops.kernels.bind_kernels`).
    kernels: Kernels | None = None

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d_in = cfg.moe_latent_size or cfg.hidden_size
        self.up_proj = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.moe_intermediate_size, d_in))
        self.down_proj = nn.Parameter(torch.empty(cfg.n_routed_experts, d_in, cfg.moe_intermediate_size))
        activation(cfg.mlp_hidden_act)  # (refuses an unknown name at load)
        self.act_name = cfg.mlp_hidden_act

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.kernels.moe_experts(x, self.up_proj, self.down_proj, idx, weights, activation=self.act_name,
                                        w_up_scale=self.scale("up_proj"), w_down_scale=self.scale("down_proj"),
                                        block=self.block)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = TopkRouter(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_shared_expert_intermediate_size,
                                  cfg.mlp_hidden_act, cfg.mlp_bias)
        if cfg.moe_latent_size is not None:
            self.fc1_latent_proj = nn.Linear(cfg.hidden_size, cfg.moe_latent_size, bias=cfg.mlp_bias)
            self.fc2_latent_proj = nn.Linear(cfg.moe_latent_size, cfg.hidden_size, bias=cfg.mlp_bias)
        else:
            self.fc1_latent_proj = self.fc2_latent_proj = None

    def forward(self, x: torch.Tensor, batch=None) -> torch.Tensor:
        idx, weights = self.gate(x)
        h = self.fc1_latent_proj(x) if self.fc1_latent_proj is not None else x
        h = self.experts(h, idx, weights)
        if self.fc2_latent_proj is not None:
            h = self.fc2_latent_proj(h)
        return h + self.shared_experts(x, batch)
