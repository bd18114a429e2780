"""Which implementation an op runs: the Triton kernels on CUDA tensors (when `triton` imports), the torch
references elsewhere. Kernels exist for the decode / verify state updates, paged attention and its KV
write, the prefill conv and the prefill chunked scan, the norms (a residual add fused into the next one),
the MLP's relu2, the few-token GEMV with the op before a linear layer fused in (`fused_linear`), a chained
verify step's inputs and the speculative sampling of rows at a temperature (`tempered_decisions`), with top-k /
top-p too (`filtered_decisions`); MoE still runs the torch reference everywhere (issue #7).

`BATON_KERNELS=torch` forces the references (to rule a kernel out when debugging); `=triton` forces the
kernels, which on CPU tensors run in Triton's interpreter (`TRITON_INTERPRET=1`, as the tests do).
The kernels do not validate slot indices on the host (that would be a sync per layer); the scheduler's
one slot per request satisfies their contract by construction, and the references check it on CPU.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable

import torch

MODES = ("auto", "torch", "triton")


@functools.cache
def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(t: torch.Tensor) -> bool:
    mode = os.environ.get("BATON_KERNELS", "auto")
    if mode not in MODES:
        raise ValueError(f"BATON_KERNELS: expected one of {', '.join(MODES)}, got {mode!r}")
    if mode == "auto":
        return t.is_cuda and _triton_available()
    return mode == "triton"


def conv_update(t: torch.Tensor) -> Callable:
    if use_triton(t):
        from baton.engine.ops.triton_conv import causal_conv1d_update_triton
        return causal_conv1d_update_triton
    from baton.engine.ops.causal_conv1d import causal_conv1d_update
    return causal_conv1d_update


def state_update(t: torch.Tensor) -> Callable:
    if use_triton(t):
        from baton.engine.ops.triton_ssu import selective_state_update_triton
        return selective_state_update_triton
    from baton.engine.ops.selective_state_update import selective_state_update
    return selective_state_update


def conv_update_verify(t: torch.Tensor) -> Callable:
    if use_triton(t):
        from baton.engine.ops.triton_conv import causal_conv1d_update_verify_triton
        return causal_conv1d_update_verify_triton
    from baton.engine.ops.spec_state_update import causal_conv1d_update_verify
    return causal_conv1d_update_verify


def state_update_verify(t: torch.Tensor) -> Callable:
    if use_triton(t):
        from baton.engine.ops.triton_ssu import selective_state_update_verify_triton
        return selective_state_update_verify_triton
    from baton.engine.ops.spec_state_update import selective_state_update_verify
    return selective_state_update_verify


def paged_attention(t: torch.Tensor) -> Callable:
    if use_triton(t):
        from baton.engine.ops.triton_attention import paged_attention_triton
        return paged_attention_triton
    from baton.engine.ops.paged_attention import paged_attention as reference
    return reference


def write_kv(t: torch.Tensor) -> Callable:
    if use_triton(t):
        from baton.engine.ops.triton_kv_write import write_kv_triton
        return write_kv_triton
    from baton.engine.ops.paged_attention import write_kv as reference
    return reference


def conv_varlen(t: torch.Tensor) -> Callable:
    if use_triton(t):
        from baton.engine.ops.triton_conv_varlen import causal_conv1d_varlen_triton
        return causal_conv1d_varlen_triton
    from baton.engine.ops.causal_conv1d import causal_conv1d_varlen
    return causal_conv1d_varlen


def chunk_scan(t: torch.Tensor) -> Callable:
    if use_triton(t):
        from baton.engine.ops.triton_ssd import mamba_chunk_scan_varlen_triton
        return mamba_chunk_scan_varlen_triton
    from baton.engine.ops.mamba_chunk_scan import mamba_chunk_scan_varlen
    return mamba_chunk_scan_varlen


def relu2(t: torch.Tensor) -> Callable:
    if use_triton(t):
        from baton.engine.ops.triton_act import relu2_triton
        return relu2_triton
    from baton.engine.ops.act import relu2_reference
    return relu2_reference


def rms_norm(t: torch.Tensor) -> Callable:
    if use_triton(t):
        from baton.engine.ops.triton_norm import rms_norm_triton
        return rms_norm_triton
    from baton.engine.ops.norm import rms_norm_reference
    return rms_norm_reference


def add_rms_norm(t: torch.Tensor) -> Callable:
    if use_triton(t):
        from baton.engine.ops.triton_norm import add_rms_norm_triton
        return add_rms_norm_triton
    from baton.engine.ops.norm import add_rms_norm_reference
    return add_rms_norm_reference


def gated_rms_norm(t: torch.Tensor) -> Callable:
    if use_triton(t):
        from baton.engine.ops.triton_norm import gated_rms_norm_triton
        return gated_rms_norm_triton
    from baton.engine.ops.norm import gated_rms_norm_reference
    return gated_rms_norm_reference


def fused_linear(t: torch.Tensor) -> Callable:
    if use_triton(t):
        from baton.engine.ops.triton_gemv import fused_linear_triton
        return fused_linear_triton
    from baton.engine.ops.fused_linear import fused_linear as reference
    return reference


def chain_inputs(t: torch.Tensor) -> Callable:
    if use_triton(t):
        from baton.engine.ops.triton_chain_inputs import chain_inputs_triton
        return chain_inputs_triton
    from baton.engine.ops.chain_inputs import chain_inputs as reference
    return reference


def tempered_decisions(t: torch.Tensor) -> Callable:
    if use_triton(t):
        from baton.engine.ops.triton_tempered_verify import tempered_decisions_triton
        return tempered_decisions_triton
    from baton.engine.ops.tempered_verify import tempered_decisions as reference
    return reference


def filtered_decisions(t: torch.Tensor) -> Callable:
    if use_triton(t):
        from baton.engine.ops.triton_tempered_verify import filtered_decisions_triton
        return filtered_decisions_triton
    from baton.engine.ops.tempered_verify import filtered_decisions as reference
    return reference
