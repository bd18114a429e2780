"""Which implementation every op runs, decided once per engine: `resolve_kernels(EngineConfig.kernels, device)`.

"auto" takes the Triton kernels on a CUDA device (when `triton` imports) and the torch references elsewhere;
"torch" forces the references (to rule a kernel out when debugging); "triton" forces the kernels, which on a CPU
run in Triton's interpreter (`TRITON_INTERPRET=1`, as the tests do). The model is bound to one `Kernels` at load
and the runners and graphs read it from there: nothing reads the choice again per call.

Kernels exist for the decode / verify state updates, paged attention and its KV write, the prefill conv and the
prefill chunked scan, the norms (a residual add fused into the next one), the MLP's relu2, the few-token GEMV with
the op before a linear layer fused in (`fused_linear`), a chained verify step's inputs and the speculative
sampling of rows at a temperature (`tempered_decisions`), with top-k / top-p too (`filtered_decisions`), the
sampling extras (`process_logits`: logit_bias, min_tokens, the penalties and min_p; `logprob_pack`), and the
routed experts of both MoE layers (`moe_experts`: NemotronH's and Qwen3.5-MoE's, fused-MoE grouped GEMMs on 16-bit
or FP8 expert weights) and their routing (`moe_route_sigmoid`, `moe_route_softmax`: one launch a layer). The Gated
DeltaNet ops (decode, verify by replay, chunked varlen prefill), its norm-then-gate and Qwen3.5's RoPE have kernels.
The kernels do not validate slot indices on the host (that would be a sync per layer); the scheduler's
one slot per request satisfies their contract by construction, and the references check it on CPU.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

from baton.engine.engine_config import check_kernel_mode


@dataclass(frozen=True)
class Kernels:
    """One implementation per op, each either every op's Triton kernel (`triton`) or every op's reference."""

    triton: bool
    conv_update: Callable
    conv_update_verify: Callable
    conv_varlen: Callable
    state_update: Callable
    state_update_verify: Callable
    chunk_scan: Callable
    paged_attention: Callable
    write_kv: Callable
    rms_norm: Callable
    add_rms_norm: Callable
    gated_rms_norm: Callable
    relu2: Callable
    fused_linear: Callable
    moe_experts: Callable
    moe_route_sigmoid: Callable
    moe_route_softmax: Callable
    chain_inputs: Callable
    tempered_decisions: Callable
    filtered_decisions: Callable
    # The sampling extras: logits processing (`logits_processing.apply_processing`'s signature) and logprob rows
    # (`logprobs.pack`'s)
    process_logits: Callable
    logprob_pack: Callable
    # Qwen3.5's ops
    gated_delta_decode: Callable
    gated_delta_prefill: Callable
    gated_delta_verify: Callable
    norm_gate: Callable
    rope: Callable


@functools.cache
def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_kernels(mode: str, device: torch.device | str) -> Kernels:
    """The ops `mode` ("auto" | "torch" | "triton") picks for an engine on `device`."""
    check_kernel_mode(mode)
    if mode == "auto":
        return _kernels(torch.device(device).type == "cuda" and _triton_available())
    return _kernels(mode == "triton")


def _gated_delta(triton: bool) -> dict[str, Callable]:
    """The Gated DeltaNet ops and its output norm, and RoPE."""
    if triton:
        from baton.engine.ops.gated_delta.kernel import gated_delta_decode_triton, gated_delta_verify_triton
        from baton.engine.ops.gated_delta.kernel_prefill import gated_delta_prefill_varlen_triton
        from baton.engine.ops.norm.kernel_norm_gate import norm_gate_triton
        from baton.engine.ops.rope.kernel import apply_rope_triton
        return dict(gated_delta_decode=gated_delta_decode_triton, gated_delta_prefill=gated_delta_prefill_varlen_triton,
                    gated_delta_verify=gated_delta_verify_triton, norm_gate=norm_gate_triton, rope=apply_rope_triton)
    from baton.engine.ops.gated_delta.reference import (
        gated_delta_decode,
        gated_delta_prefill_varlen,
        gated_delta_verify,
    )
    from baton.engine.ops.norm.reference import norm_gate_reference
    from baton.engine.ops.rope.reference import apply_rope
    return dict(gated_delta_decode=gated_delta_decode, gated_delta_prefill=gated_delta_prefill_varlen,
                gated_delta_verify=gated_delta_verify, norm_gate=norm_gate_reference, rope=apply_rope)


@functools.cache
def _kernels(triton: bool) -> Kernels:
    # Imported here: the Triton modules import `triton`, which a CPU-only install may lack.
    if triton:
        from baton.engine.ops.act.kernel import relu2_triton
        from baton.engine.ops.attention.kernel import paged_attention_triton
        from baton.engine.ops.attention.kernel_kv_write import write_kv_triton
        from baton.engine.ops.chain_inputs.kernel import chain_inputs_triton
        from baton.engine.ops.chunk_scan.kernel import mamba_chunk_scan_varlen_triton
        from baton.engine.ops.conv.kernel import (
            causal_conv1d_update_triton,
            causal_conv1d_update_verify_triton,
        )
        from baton.engine.ops.conv.kernel_varlen import causal_conv1d_varlen_triton
        from baton.engine.ops.linear.kernel import fused_linear_triton
        from baton.engine.ops.logits_process.kernel import apply_processing_triton
        from baton.engine.ops.logprob_topk.kernel import pack_triton
        from baton.engine.ops.moe.kernel import moe_experts_triton
        from baton.engine.ops.moe.kernel_route import route_sigmoid_grouped_triton, route_softmax_triton
        from baton.engine.ops.norm.kernel import add_rms_norm_triton, gated_rms_norm_triton, rms_norm_triton
        from baton.engine.ops.ssm_update.kernel import (
            selective_state_update_triton,
            selective_state_update_verify_triton,
        )
        from baton.engine.ops.tempered_verify.kernel import (
            filtered_decisions_triton,
            tempered_decisions_triton,
        )
        return Kernels(
            triton=True, conv_update=causal_conv1d_update_triton, conv_update_verify=causal_conv1d_update_verify_triton,
            conv_varlen=causal_conv1d_varlen_triton, state_update=selective_state_update_triton,
            state_update_verify=selective_state_update_verify_triton, chunk_scan=mamba_chunk_scan_varlen_triton,
            paged_attention=paged_attention_triton, write_kv=write_kv_triton, rms_norm=rms_norm_triton,
            add_rms_norm=add_rms_norm_triton, gated_rms_norm=gated_rms_norm_triton, relu2=relu2_triton,
            fused_linear=fused_linear_triton, moe_experts=moe_experts_triton,
            moe_route_sigmoid=route_sigmoid_grouped_triton, moe_route_softmax=route_softmax_triton,
            chain_inputs=chain_inputs_triton,
            tempered_decisions=tempered_decisions_triton, filtered_decisions=filtered_decisions_triton,
            process_logits=apply_processing_triton, logprob_pack=pack_triton, **_gated_delta(True))
    from baton.engine.logits_processing import apply_processing
    from baton.engine.logprobs import pack
    from baton.engine.ops.act.reference import relu2_reference
    from baton.engine.ops.attention.reference import paged_attention, write_kv
    from baton.engine.ops.chain_inputs.reference import chain_inputs
    from baton.engine.ops.chunk_scan.reference import mamba_chunk_scan_varlen
    from baton.engine.ops.conv.reference import (
        causal_conv1d_update,
        causal_conv1d_update_verify,
        causal_conv1d_varlen,
    )
    from baton.engine.ops.linear.reference import fused_linear
    from baton.engine.ops.moe.reference import moe_experts_reference, route_sigmoid_grouped, route_softmax
    from baton.engine.ops.norm.reference import (
        add_rms_norm_reference,
        gated_rms_norm_reference,
        rms_norm_reference,
    )
    from baton.engine.ops.ssm_update.reference import selective_state_update, selective_state_update_verify
    from baton.engine.ops.tempered_verify.reference import filtered_decisions, tempered_decisions
    return Kernels(
        triton=False, conv_update=causal_conv1d_update, conv_update_verify=causal_conv1d_update_verify,
        conv_varlen=causal_conv1d_varlen, state_update=selective_state_update,
        state_update_verify=selective_state_update_verify, chunk_scan=mamba_chunk_scan_varlen,
        paged_attention=paged_attention, write_kv=write_kv, rms_norm=rms_norm_reference,
        add_rms_norm=add_rms_norm_reference, gated_rms_norm=gated_rms_norm_reference, relu2=relu2_reference,
        fused_linear=fused_linear, moe_experts=moe_experts_reference, moe_route_sigmoid=route_sigmoid_grouped,
        moe_route_softmax=route_softmax, chain_inputs=chain_inputs,
        tempered_decisions=tempered_decisions, filtered_decisions=filtered_decisions, process_logits=apply_processing,
        logprob_pack=pack, **_gated_delta(False))


def bind_kernels(root: torch.nn.Module, kernels: Kernels) -> None:
    """Give every module under `root` that runs ops (its class declares `kernels`) this engine's choice."""
    for module in root.modules():
        if hasattr(type(module), "kernels"):
            module.kernels = kernels
