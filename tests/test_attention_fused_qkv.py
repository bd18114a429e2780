"""Attention's q/k/v projections as one GEMM: the checkpoint's names and values stay, the outputs do not change."""

from __future__ import annotations

import pytest
import torch

from baton.engine.config import ATTENTION
from baton.engine.layers.attention import Attention
from baton.engine.loader import load_checkpoint
from baton.engine.make_model import make_model
from baton.engine.model import NemotronHForCausalLM
from baton.engine.mtp import MTPModule
from baton.engine.ops.kernels import resolve_kernels


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = make_model(tmp_path_factory.mktemp("qkv") / "tiny", "tiny", mtp_layers=1, progress=False,
                     overrides={"mtp_hybrid_override_pattern": "*-"}, tokenizer=False)
    return load_checkpoint(out)


def _attentions(module: torch.nn.Module) -> list[Attention]:
    return [m for m in module.modules() if isinstance(m, Attention)]


def test_loaded_model_and_drafter_run_one_qkv_gemm_over_the_checkpoint_values(ckpt):
    cfg, state = ckpt
    model = NemotronHForCausalLM.from_state_dict(cfg, state, "cpu", torch.float32, resolve_kernels("auto", "cpu"))
    mtp = MTPModule.from_state_dict(cfg, state, "cpu", torch.float32, resolve_kernels("auto", "cpu"))
    n_attn = sum(t == ATTENTION for t in cfg.layer_types)
    assert len(_attentions(model)) == n_attn > 0 and len(_attentions(mtp)) == 1
    for attn in _attentions(model) + _attentions(mtp):
        assert attn._fused() is not None
    # The state dicts still hold the checkpoint's tensors under its names, as views of the fused weight.
    sd = model.state_dict()
    for k, v in state.items():
        if not k.startswith("mtp."):
            assert torch.equal(sd[k], v), k
    attn = _attentions(model)[0]
    q, k, v = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight
    assert torch.equal(attn._fused(), torch.cat([q, k, v]))
    assert q.untyped_storage().data_ptr() == attn._fused().untyped_storage().data_ptr()


def test_fused_outputs_equal_three_projections(ckpt):
    cfg, state = ckpt
    attn = _attentions(NemotronHForCausalLM.from_state_dict(cfg, state, "cpu", torch.float32, resolve_kernels("auto", "cpu")))[0]
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    fused = torch.nn.functional.linear(x, attn._fused())
    three = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)
    torch.testing.assert_close(fused, three, atol=1e-6, rtol=1e-6)


def test_in_place_load_writes_through_and_assign_unties(ckpt):
    cfg, state = ckpt
    model = NemotronHForCausalLM.from_state_dict(cfg, state, "cpu", torch.float32, resolve_kernels("auto", "cpu"))
    attn = _attentions(model)[0]
    new_k = torch.randn_like(attn.k_proj.weight)
    attn.k_proj.load_state_dict({"weight": new_k})  # in place: the fused weight sees it
    nq = attn.q_proj.weight.shape[0]
    assert attn._fused() is not None and torch.equal(attn._fused()[nq:nq + new_k.shape[0]], new_k)
    attn.v_proj.load_state_dict({"weight": torch.zeros_like(attn.v_proj.weight)}, assign=True)
    assert attn._fused() is None  # a new tensor: three GEMMs until fused again
    x = torch.randn(3, cfg.hidden_size)
    attn.fuse_qkv()
    assert attn._fused() is not None and torch.equal(attn.v_proj(x), torch.zeros(3, attn.v_proj.weight.shape[0]))
