"""Programmatic dependent launch (`ops.triton_common.pdl`): on Hopper the kernels of small steps (at most
PDL_MAX_ROWS rows) launch while the one before them finishes and wait for it before touching its data. Off on the
CPU and in the interpreter."""

from __future__ import annotations

import pytest
import torch

from baton.engine.ops.triton_common import pdl


def test_pdl_is_off_on_the_cpu():
    assert pdl(torch.zeros(1)) == {"PDL": False, "launch_pdl": False}


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


@pytest.mark.gpu
def test_gpu_pdl_chain_in_a_graph_equals_serial_launches(monkeypatch):
    """A chain of kernels each reading the one before (GEMV with add + norm -> gated norm -> GEMV -> ...), captured
    in a CUDA graph with PDL, gives the bits of the same chain launched without it: every kernel waits before it
    reads its input or overwrites a buffer an earlier kernel still reads (the graph's pool reuses them)."""
    from baton.engine.ops.linear.kernel import fused_linear_triton
    from baton.engine.ops.norm.kernel import gated_rms_norm_triton

    if not _hopper():
        pytest.skip("PDL needs compute capability 9.0")
    g = torch.Generator(device="cuda").manual_seed(0)
    k, n = 4096, 8192
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / 64 for _ in range(4)]
    vs = [torch.randn(k, n, device="cuda", dtype=torch.bfloat16, generator=g) / 90 for _ in range(4)]
    nw = torch.rand(k, device="cuda", dtype=torch.bfloat16, generator=g) + 0.5
    gw = torch.rand(n, device="cuda", dtype=torch.bfloat16, generator=g) + 0.5
    x0 = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=g)

    def chain(x):
        res = x
        for w, v in zip(ws, vs, strict=True):
            up, res = fused_linear_triton(x, w, prologue="add_norm", residual=res, norm_weight=nw)
            h = gated_rms_norm_triton(up, up, gw, 1024, 1e-5)
            x = fused_linear_triton(h, v)
        return x + res

    def graphed(flag: str):
        monkeypatch.setenv("BATON_PDL", flag)
        assert pdl(x0)["launch_pdl"] is (flag == "1")
        chain(x0)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(x0)
        outs = []
        for _ in range(20):
            graph.replay()
            outs.append(out.clone())
        torch.cuda.synchronize()
        return outs

    serial = graphed("0")
    overlapped = graphed("1")
    assert all(torch.equal(serial[0], o) for o in serial + overlapped)


def test_fused_gemv_default_is_decided_by_the_device():
    from baton.engine.engine_config import EngineConfig
    from baton.engine.llm_engine import resolved_fused_gemv_max_tokens

    assert EngineConfig().fused_gemv_max_tokens is None
    assert resolved_fused_gemv_max_tokens(EngineConfig(), torch.device("cpu")) == 0
    assert resolved_fused_gemv_max_tokens(EngineConfig(fused_gemv_max_tokens=4), torch.device("cpu")) == 4
    with pytest.raises(ValueError, match="fused_gemv_max_tokens': expected an integer >= 0 or None, got -1"):
        EngineConfig(fused_gemv_max_tokens=-1)


@pytest.mark.gpu
def test_gpu_fused_gemv_default_is_the_measured_gpus_own():
    from baton.engine.engine_config import EngineConfig
    from baton.engine.llm_engine import resolved_fused_gemv_max_tokens
    from baton.engine.ops.linear.tuning import FUSED_GEMV_GPUS

    name = torch.cuda.get_device_name()
    want = FUSED_GEMV_GPUS.get(next((g for g in FUSED_GEMV_GPUS if g in name), ""), 0)
    assert want == (48 if "H200" in name else 1 if "H100" in name else 0)
    assert resolved_fused_gemv_max_tokens(EngineConfig(), torch.device("cuda")) == want


@pytest.mark.gpu
def test_gpu_pdl_only_up_to_max_rows(monkeypatch):
    """Kernels over more than PDL_MAX_ROWS rows launch without PDL; a graph mixing both kinds of launch (a
    one-row GEMV chain feeding a wide norm and back) gives the bits of the serial chain."""
    from baton.engine.ops.linear.kernel import fused_linear_triton
    from baton.engine.ops.norm.kernel import gated_rms_norm_triton
    from baton.engine.ops.triton_common import PDL_MAX_ROWS

    if not _hopper():
        pytest.skip("PDL needs compute capability 9.0")
    monkeypatch.setenv("BATON_PDL", "1")
    assert pdl(torch.zeros(PDL_MAX_ROWS, 8, device="cuda"))["launch_pdl"] is True
    assert pdl(torch.zeros(PDL_MAX_ROWS + 1, 8, device="cuda")) == {"PDL": False, "launch_pdl": False}
    g = torch.Generator(device="cuda").manual_seed(1)
    k, n = 1024, 2048
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / 32
    gw = torch.rand(k, device="cuda", dtype=torch.bfloat16, generator=g) + 0.5
    x0 = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=g)

    def chain(x):
        for _ in range(3):
            up = fused_linear_triton(x, w)  # one row: PDL
            wide = up.reshape(-1, k).repeat(PDL_MAX_ROWS, 1)  # 2 * PDL_MAX_ROWS rows: no PDL
            h = gated_rms_norm_triton(wide, wide, gw, 256, 1e-5)
            x = h[-1:].contiguous()
        return x

    def run(flag: str):
        monkeypatch.setenv("BATON_PDL", flag)
        chain(x0)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(x0)
        graph.replay()
        torch.cuda.synchronize()
        return out.clone()

    assert torch.equal(run("0"), run("1"))
