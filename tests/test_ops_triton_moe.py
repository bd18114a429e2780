"""The fused-MoE kernels (align, grouped GEMM up with the activation fused, down with the routing weight fused, the
top-k sum) against the torch reference of `ops.moe`, and the routing the two paths share against HF's.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET is set before the kernel
modules are imported), on small shapes: E=8, hidden 32, intermediate 16 / 24, 1 / 3 / 17 tokens. The `gpu` tests run
the compiled kernels at Nemotron-3-Nano-like and Qwen3-Next-like sizes, and replay the path in a CUDA graph.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from torch import Tensor  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (the Makefile's CPU install must add it)")
pytestmark = pytest.mark.interpreter  # CPU tensors through the interpreter; the `gpu` tests run compiled

from baton.engine.ops.moe.kernel import moe_experts_triton  # noqa: E402
from baton.engine.ops.moe.kernel_align import moe_align_triton  # noqa: E402
from baton.engine.ops.moe.reference import (  # noqa: E402
    align_reference,
    max_padded_rows,
    moe_experts_reference,
    route_sigmoid_grouped,
    route_softmax,
)
from baton.engine.ops.moe.tuning import INTERPRETER, LARGE, SMALL  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
E, HIDDEN = 8, 32
# (dtype, atol, rtol): fp32 differs from torch by the order of the fp32 sums; 16-bit by where the kernel rounds
# (the activation is taken on the fp32 accumulator, the reference's on the linear's rounded output).
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (3e-2, 3e-2), torch.float16: (5e-3, 5e-3)}


def _weights(num_experts, hidden, inter, gated, dtype, gen, device=DEV) -> tuple[Tensor, Tensor]:
    rows = 2 * inter if gated else inter
    w_up = torch.randn(num_experts, rows, hidden, generator=gen) / hidden ** 0.5
    w_down = torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5
    return w_up.to(device, dtype), w_down.to(device, dtype)


def _routing(t, num_experts, top_k, grouped, gen, device=DEV) -> tuple[Tensor, Tensor]:
    logits = torch.randn(t, num_experts, generator=gen).to(device)
    if grouped:  # NemotronH's router: 4 groups, the best 2, renormalised and scaled
        bias = (torch.randn(num_experts, generator=gen) * 0.1).to(device)
        return route_sigmoid_grouped(logits, bias, 4, 2, top_k, True, 2.5)
    return route_softmax(logits, top_k, True)


def _check_layout(ids: Tensor, num_experts: int, block_m: int, sorted_ids: Tensor, expert_ids: Tensor,
                  total: Tensor) -> None:
    """The align contract: every (token, slot) row once, in its expert's blocks, in increasing row order per expert,
    each expert padded to block_m, sentinels elsewhere."""
    flat = ids.reshape(-1).long().cpu()
    n = flat.numel()
    s, b, tot = sorted_ids.long().cpu(), expert_ids.long().cpu(), int(total.item())
    assert s.numel() == max_padded_rows(n, num_experts, block_m) and b.numel() == -(-s.numel() // block_m)
    counts = torch.bincount(flat, minlength=num_experts)
    assert tot == int(((counts + block_m - 1) // block_m * block_m).sum()) and tot % block_m == 0
    real = s[s < n]
    assert sorted(real.tolist()) == list(range(n))  # each row exactly once
    assert (s[tot:] == n).all() and (b[tot // block_m:] == -1).all()
    assert (b[: tot // block_m] >= 0).all() and (b[: tot // block_m].diff() >= 0).all()
    for blk in range(tot // block_m):
        rows = s[blk * block_m:(blk + 1) * block_m]
        rows = rows[rows < n]
        assert (flat[rows] == b[blk]).all()
    for e in range(num_experts):
        mine = s[(s < n)][flat[s[s < n]] == e]
        assert (mine.diff() > 0).all() and mine.numel() == counts[e]


@pytest.mark.parametrize(("t", "top_k", "block_m"), [(1, 2, 16), (3, 3, 16), (17, 3, 16), (17, 2, 32), (0, 2, 16)])
def test_align_matches_the_reference_and_its_contract(t, top_k, block_m):
    gen = torch.Generator().manual_seed(t * 10 + top_k)
    ids, _ = _routing(t, E, top_k, False, gen)
    got = moe_align_triton(ids, E, block_m)
    want = align_reference(ids, E, block_m)
    if t:
        for g, w in zip(got, want, strict=True):
            assert g.dtype == torch.int32 and torch.equal(g, w)
        _check_layout(ids, E, block_m, *got)
    else:
        assert int(got[2].item()) == 0 and got[0].numel() == 0


def test_align_of_one_expert_takes_only_its_blocks():
    ids = torch.full((17, 1), 5, dtype=torch.int64, device=DEV)
    sorted_ids, expert_ids, total = moe_align_triton(ids, E, 16)
    assert int(total.item()) == 32 and expert_ids[:2].tolist() == [5, 5] and (expert_ids[2:] == -1).all()
    assert sorted_ids[:17].tolist() == list(range(17)) and (sorted_ids[17:] == 17).all()
    _check_layout(ids, E, 16, sorted_ids, expert_ids, total)


CASES = [  # (tokens, top_k, inter, gated, grouped routing, dtype)
    (1, 2, 16, False, True, torch.float32),
    (3, 3, 24, False, True, torch.float32),
    (17, 3, 24, False, True, torch.float32),
    (1, 2, 16, True, False, torch.float32),
    (3, 2, 24, True, False, torch.float32),
    (17, 3, 16, True, False, torch.float32),
    (17, 3, 24, False, True, torch.bfloat16),
    (17, 2, 24, True, False, torch.bfloat16),
    (3, 3, 16, True, False, torch.float16),
]


@pytest.mark.parametrize(("t", "top_k", "inter", "gated", "grouped", "dtype"), CASES)
def test_experts_match_the_reference(t, top_k, inter, gated, grouped, dtype):
    gen = torch.Generator().manual_seed(t + 100 * top_k + inter)
    w_up, w_down = _weights(E, HIDDEN, inter, gated, dtype, gen)
    x = torch.randn(t, HIDDEN, generator=gen).to(DEV, dtype)
    ids, weights = _routing(t, E, top_k, grouped, gen)
    weights = weights.to(dtype) if gated else weights  # as the layers pass them (Qwen's in x's dtype)
    act = "silu" if gated else "relu2"
    got = moe_experts_triton(x, w_up, w_down, ids, weights, activation=act, gated=gated, tiles=INTERPRETER)
    want = moe_experts_reference(x, w_up, w_down, ids, weights, activation=act, gated=gated)
    atol, rtol = TOL[dtype]
    assert got.dtype == dtype and got.shape == (t, HIDDEN)
    torch.testing.assert_close(got, want, atol=atol * want.abs().max().item(), rtol=rtol)


@pytest.mark.parametrize("activation", ["relu", "silu"])
def test_other_non_gated_activations(activation):
    gen = torch.Generator().manual_seed(7)
    w_up, w_down = _weights(E, HIDDEN, 16, False, torch.float32, gen)
    x = torch.randn(3, HIDDEN, generator=gen).to(DEV)
    ids, weights = _routing(3, E, 2, True, gen)
    got = moe_experts_triton(x, w_up, w_down, ids, weights, activation=activation, tiles=INTERPRETER)
    want = moe_experts_reference(x, w_up, w_down, ids, weights, activation=activation)
    torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=1e-5)


def test_all_tokens_on_one_expert():
    """Every expert empty but one: one expert's rows fill its blocks, the others' blocks do not exist."""
    gen = torch.Generator().manual_seed(3)
    w_up, w_down = _weights(E, HIDDEN, 24, False, torch.float32, gen)
    x = torch.randn(17, HIDDEN, generator=gen).to(DEV)
    ids = torch.full((17, 1), 6, dtype=torch.int64, device=DEV)
    weights = torch.rand(17, 1, generator=gen).to(DEV)
    got = moe_experts_triton(x, w_up, w_down, ids, weights, tiles=INTERPRETER)
    want = torch.relu(x @ w_up[6].T).square() @ w_down[6].T * weights
    torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=1e-5)


def test_no_tokens():
    gen = torch.Generator().manual_seed(0)
    w_up, w_down = _weights(E, HIDDEN, 16, True, torch.float32, gen)
    x = torch.empty(0, HIDDEN, device=DEV)
    ids = torch.empty(0, 2, dtype=torch.int64, device=DEV)
    out = moe_experts_triton(x, w_up, w_down, ids, torch.empty(0, 2, device=DEV), activation="silu", gated=True)
    assert out.shape == (0, HIDDEN)


def test_bad_arguments_are_refused():
    gen = torch.Generator().manual_seed(0)
    w_up, w_down = _weights(E, HIDDEN, 16, False, torch.float32, gen)
    x = torch.randn(3, HIDDEN, device=DEV)
    ids, weights = _routing(3, E, 2, False, gen)
    with pytest.raises(ValueError, match=r"w_down expected shape \[E=8, d_out, I=16\], got \(8, 32, 24\)"):
        moe_experts_triton(x, w_up, torch.zeros(E, HIDDEN, 24, device=DEV), ids, weights)
    with pytest.raises(ValueError, match="topk_weights expected shape"):
        moe_experts_reference(x, w_up, w_down, ids, weights[:, :1])
    with pytest.raises(ValueError, match="activation"):
        moe_experts_triton(x, w_up, w_down, ids, weights, activation="gelu")
    with pytest.raises(ValueError, match="gated w_up"):
        moe_experts_reference(x, torch.zeros(E, 15, HIDDEN), torch.zeros(E, HIDDEN, 7), ids, weights, gated=True)
    with pytest.raises(TypeError, match="one dtype"):
        moe_experts_triton(x.bfloat16(), w_up, w_down, ids, weights)


def test_grouped_routing_is_hf_nemotron_h():
    """The router `ops.moe` keeps (one copy, the layer calls it) picks HF NemotronH's experts and weights."""
    hf = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
    from transformers import NemotronHConfig

    cfg = NemotronHConfig(hidden_size=HIDDEN, n_routed_experts=16, num_experts_per_tok=3, n_group=4, topk_group=2,
                          norm_topk_prob=True, routed_scaling_factor=2.5)
    router = hf.NemotronHTopkRouter(cfg)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, HIDDEN, generator=gen))
        router.e_score_correction_bias.copy_(torch.randn(16, generator=gen) * 0.1)
    x = torch.randn(17, HIDDEN, generator=gen)
    _, hf_w, hf_idx = router(x)
    logits = torch.nn.functional.linear(x, router.weight)
    idx, w = route_sigmoid_grouped(logits, router.e_score_correction_bias, 4, 2, 3, True, 2.5)
    assert torch.equal(idx, hf_idx) and torch.equal(w, hf_w)
    groups = idx // 4  # every pick within the 2 chosen groups
    assert all(len(set(g.tolist())) <= 2 for g in groups)


def test_the_engine_kernels_pick_the_moe_path():
    from baton.engine.ops.kernels import resolve_kernels

    assert resolve_kernels("triton", "cpu").moe_experts is moe_experts_triton
    assert resolve_kernels("torch", "cpu").moe_experts is moe_experts_reference


# --- compiled, at model sizes ---------------------------------------------------------------------------------------

# Nemotron-3-Nano-30B-A3B's experts (relu2) and Qwen3-Next-80B-A3B's (gated SiLU).
NANO = dict(num_experts=128, top_k=6, hidden=2688, inter=1856, gated=False)
QWEN_NEXT = dict(num_experts=512, top_k=10, hidden=2048, inter=512, gated=True)


def _model_case(shape, t, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    w_up, w_down = _weights(shape["num_experts"], shape["hidden"], shape["inter"], shape["gated"], dtype, gen)
    x = torch.randn(t, shape["hidden"], generator=gen).to(DEV, dtype)
    logits = torch.randn(t, shape["num_experts"], generator=gen).to(DEV)
    if shape["gated"]:
        ids, weights = route_softmax(logits, shape["top_k"], True)
        weights = weights.to(dtype)
    else:
        ids, weights = route_sigmoid_grouped(logits, torch.zeros(shape["num_experts"], device=DEV), 1, 1,
                                             shape["top_k"], True, 2.5)
    return x, w_up, w_down, ids, weights


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [NANO, QWEN_NEXT], ids=["nano", "qwen-next"])
@pytest.mark.parametrize("t", [1, 7, 64, 300, 2048])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_model_sizes_match_the_reference(shape, t, dtype):
    x, w_up, w_down, ids, weights = _model_case(shape, t, dtype, t)
    act = "silu" if shape["gated"] else "relu2"
    got = moe_experts_triton(x, w_up, w_down, ids, weights, activation=act, gated=shape["gated"])
    want = moe_experts_reference(x, w_up, w_down, ids, weights, activation=act, gated=shape["gated"])
    atol, rtol = (3e-2, 3e-2) if dtype == torch.bfloat16 else (1e-4, 1e-4)
    torch.testing.assert_close(got, want, atol=atol * want.abs().max().item(), rtol=rtol)


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [SMALL, LARGE], ids=["small", "large"])
def test_both_tilings_compile_and_match(tiles):
    x, w_up, w_down, ids, weights = _model_case(NANO, 256, torch.bfloat16, 1)
    got = moe_experts_triton(x, w_up, w_down, ids, weights, tiles=tiles)
    want = moe_experts_reference(x, w_up, w_down, ids, weights)
    torch.testing.assert_close(got, want, atol=3e-2 * want.abs().max().item(), rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [NANO, QWEN_NEXT], ids=["nano", "qwen-next"])
def test_cuda_graph_replays_other_routing(shape):
    """The whole path (align, both GEMMs, the sum) in one CUDA graph: replays with new routing (one skewed onto a
    single expert) give the reference's output, so nothing was read on the host at capture."""
    t, dtype = 48, torch.bfloat16
    act = "silu" if shape["gated"] else "relu2"
    x, w_up, w_down, ids, weights = _model_case(shape, t, dtype, 0)
    run = lambda: moe_experts_triton(x, w_up, w_down, ids, weights, activation=act, gated=shape["gated"])  # noqa: E731
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for seed in (1, 2, 3):
        x2, _, _, ids2, weights2 = _model_case(shape, t, dtype, seed)
        if seed == 3:  # all rows on experts 0..top_k-1: one expert holds every token
            ids2 = torch.arange(shape["top_k"], device=DEV).expand(t, -1).contiguous()
        x.copy_(x2)
        ids.copy_(ids2)
        weights.copy_(weights2)
        graph.replay()
        want = moe_experts_reference(x, w_up, w_down, ids, weights, activation=act, gated=shape["gated"])
        torch.testing.assert_close(out, want, atol=3e-2 * want.abs().max().item(), rtol=3e-2)
