"""MoE routing in one kernel (`ops/moe/kernel_route.py`) against the torch reference of `ops.moe`: NemotronH's
grouped sigmoid router and Qwen's softmax router pick the same experts with the same weights (per token, as sets:
the order of a token's k picks is free), on random logits and on near-ties that only the group selection decides.

Without CUDA the kernel runs in Triton's interpreter on CPU tensors; the `gpu` test runs it compiled at
Nemotron-3-Nano's and Qwen3-Next's router sizes and replays it in a CUDA graph.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (the Makefile's CPU install must add it)")
pytestmark = pytest.mark.interpreter

from baton.engine.ops.moe.kernel_route import route_sigmoid_grouped_triton, route_softmax_triton  # noqa: E402
from baton.engine.ops.moe.reference import route_sigmoid_grouped, route_softmax  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _sorted(idx: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = idx.argsort(dim=-1)
    return idx.gather(1, order), w.gather(1, order)


def check(got, want, atol=1e-6):
    gi, gw = _sorted(*got)
    wi, ww = _sorted(*want)
    assert got[0].dtype == torch.int64 and got[1].dtype == torch.float32
    assert torch.equal(gi.cpu(), wi.cpu())
    torch.testing.assert_close(gw.cpu(), ww.cpu(), atol=atol, rtol=1e-5)


@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize(("experts", "n_group", "topk_group", "top_k", "norm", "scale"), [
    (16, 1, 1, 4, True, 2.5),    # Nemotron-3-Nano's form: one group
    (24, 4, 2, 3, True, 1.0),    # groups (E not a power of two)
    (32, 8, 3, 6, False, 1.5),   # DeepSeek-like groups, no renormalisation
])
def test_sigmoid_grouped_matches_the_reference(tokens, experts, n_group, topk_group, top_k, norm, scale):
    g = torch.Generator().manual_seed(experts * 10 + tokens)
    logits = torch.randn(tokens, experts, generator=g).to(DEV)
    bias = (torch.randn(experts, generator=g) * 0.1).to(DEV)
    args = (n_group, topk_group, top_k, norm, scale)
    check(route_sigmoid_grouped_triton(logits, bias, *args), route_sigmoid_grouped(logits, bias, *args))


def test_sigmoid_groups_decide_where_scores_alone_would_not():
    """Token 0's single best expert sits in a group whose second best is poor: a plain top-k would take it, the
    group rule must not."""
    logits = torch.full((1, 16), -4.0)
    logits[0, 0] = 5.0                     # group 0: one strong, the rest weak
    logits[0, 4:8] = torch.tensor([2.0, 1.9, 1.8, 1.7])  # group 1: consistently good
    logits[0, 8:12] = torch.tensor([1.5, 1.4, 1.3, 1.2])  # group 2
    bias = torch.zeros(16)
    args = (4, 2, 2, True, 1.0)
    got = route_sigmoid_grouped_triton(logits.to(DEV), bias.to(DEV), *args)
    check(got, route_sigmoid_grouped(logits, bias, *args))
    assert sorted(got[0][0].tolist()) == [4, 5]


@pytest.mark.parametrize(("tokens", "experts", "top_k", "norm"), [(1, 8, 2, True), (7, 60, 4, True),
                                                                  (3, 64, 8, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_matches_the_reference(tokens, experts, top_k, norm, dtype):
    g = torch.Generator().manual_seed(tokens * 100 + experts)
    logits = (torch.randn(tokens, experts, generator=g) * 2).to(DEV, dtype)
    check(route_softmax_triton(logits, top_k, norm), route_softmax(logits, top_k, norm))


def test_a_strided_logits_view_and_no_tokens():
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(4, 40, generator=g).to(DEV)
    view = wide[:, 4:36]  # rows 40 apart
    check(route_softmax_triton(view, 3, True), route_softmax(view, 3, True))
    idx, w = route_softmax_triton(wide[:0, :8], 2, True)
    assert idx.shape == (0, 2) and w.shape == (0, 2)


def test_bad_arguments_are_refused():
    logits = torch.zeros(2, 12, device=DEV)
    with pytest.raises(ValueError, match="n_group dividing"):
        route_sigmoid_grouped_triton(logits, torch.zeros(12, device=DEV), 5, 1, 2, True, 1.0)
    with pytest.raises(ValueError, match="top_k expected 1..6"):
        route_sigmoid_grouped_triton(logits, torch.zeros(12, device=DEV), 4, 2, 7, True, 1.0)
    with pytest.raises(ValueError, match="correction_bias expected shape"):
        route_sigmoid_grouped_triton(logits, torch.zeros(11, device=DEV), 1, 1, 2, True, 1.0)
    with pytest.raises(ValueError, match="top_k expected 1..12"):
        route_softmax_triton(logits, 0, True)


@pytest.mark.gpu
@pytest.mark.parametrize(("experts", "top_k", "sigmoid"), [(128, 6, True), (512, 10, False)])
def test_router_sizes_compiled_and_in_a_cuda_graph(experts, top_k, sigmoid):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    g = torch.Generator().manual_seed(experts)
    logits = torch.randn(256, experts, generator=g).cuda()
    bias = (torch.randn(experts, generator=g) * 0.05).cuda()

    def run():
        if sigmoid:
            return route_sigmoid_grouped_triton(logits, bias, 1, 1, top_k, True, 2.5)
        return route_softmax_triton(logits, top_k, True)

    want = route_sigmoid_grouped(logits, bias, 1, 1, top_k, True, 2.5) if sigmoid else route_softmax(logits, top_k, True)
    check(run(), want)
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    logits.copy_(torch.randn(256, experts, generator=g).cuda())
    graph.replay()
    torch.cuda.synchronize()
    want = route_sigmoid_grouped(logits, bias, 1, 1, top_k, True, 2.5) if sigmoid else route_softmax(logits, top_k, True)
    check(out, want)
