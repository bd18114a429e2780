"""Qwen3.5's projections that read one input run as one GEMM (`layers.fused_linears`): the Gated DeltaNet's four
input projections, the gated attention's q/k/v and the MLP's gate/up, in the model and its MTP layer. The checkpoint's
names and values stay, the outputs do not change, and a load that assigns new tensors falls back to the separate
projections."""

from __future__ import annotations

import pytest
import torch

from baton.engine.layers.gated_attention import GatedAttention
from baton.engine.layers.gated_deltanet import GatedDeltaNetMixer
from baton.engine.layers.gated_mlp import GatedMLP
from baton.engine.loader import load_checkpoint
from baton.engine.make_model import make_model
from baton.engine.ops.kernels import resolve_kernels
from baton.engine.qwen3_5_model import Qwen3_5ForCausalLM
from baton.engine.qwen3_5_mtp import Qwen3_5MTP

FUSED = (GatedDeltaNetMixer, GatedAttention, GatedMLP)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = make_model(tmp_path_factory.mktemp("qwen-fused") / "m", "qwen3.5-tiny", mtp_layers=1, progress=False,
                     tokenizer=False)
    return load_checkpoint(out)


def _fused_modules(module: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in module.modules() if isinstance(m, FUSED)]


def _parts(m: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    if isinstance(m, GatedDeltaNetMixer):
        return m._in_parts()
    if isinstance(m, GatedAttention):
        return m.q_proj, m.k_proj, m.v_proj
    return m.gate_proj, m.up_proj


def test_model_and_drafter_hold_one_weight_per_fused_group_over_the_checkpoint_values(ckpt):
    cfg, state = ckpt
    kernels = resolve_kernels("auto", "cpu")
    model = Qwen3_5ForCausalLM.from_state_dict(cfg, state, "cpu", torch.float32, kernels)
    mtp = Qwen3_5MTP.from_state_dict(cfg, state, "cpu", torch.float32, kernels)
    kinds = {type(m) for m in _fused_modules(model)}
    assert kinds == set(FUSED) and {type(m) for m in _fused_modules(mtp)} >= {GatedAttention, GatedMLP}
    for m in _fused_modules(model) + _fused_modules(mtp):
        w = m._fused()
        assert w is not None, type(m).__name__
        assert torch.equal(w, torch.cat([p.weight for p in _parts(m)]))
    sd = model.state_dict()
    projections = [k for k in state if k.endswith("proj.weight") or ".in_proj_" in k]
    assert projections
    for k in projections:
        if not k.startswith("mtp."):
            assert torch.equal(sd[k], state[k].float()), k


def test_fused_and_separate_projections_give_the_same_outputs(ckpt):
    """Each fused module against itself with the ties cut (a load that assigns new tensors): the separate GEMMs."""
    cfg, state = ckpt
    model = Qwen3_5ForCausalLM.from_state_dict(cfg, state, "cpu", torch.float32, resolve_kernels("auto", "cpu"))
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    mlp = next(m for m in _fused_modules(model) if isinstance(m, GatedMLP))
    fused = mlp(x)
    for p in _parts(mlp):
        p.weight = torch.nn.Parameter(p.weight.detach().clone(), requires_grad=False)
    assert mlp._fused() is None
    torch.testing.assert_close(mlp(x), fused, atol=1e-6, rtol=1e-6)
