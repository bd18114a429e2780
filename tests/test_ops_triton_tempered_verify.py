"""Triton tempered-verify kernel (`ops.triton_tempered_verify`) against the torch reference
`rejection_sampler.tempered_decisions`: the accepted counts and drawn tokens of rows sampling at a temperature.

Both use the same counter noise; the kernel sums in another order, so a decision may differ only where the noise
falls within float32 rounding of its threshold: on these inputs they agree on every row (interpreter), and on all
but a tiny share of the full-size rows on a GPU. Without CUDA the kernel runs under TRITON_INTERPRET=1 on CPU
tensors; the `gpu` tests run it compiled.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first import of triton

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (the Makefile's CPU install lacks it)")
pytestmark = pytest.mark.interpreter  # CPU tensors through the interpreter; the `gpu` tests run compiled

from baton.engine.ops import dispatch  # noqa: E402
from baton.engine.ops.triton_tempered_verify import tempered_decisions_triton  # noqa: E402
from baton.engine.rejection_sampler import tempered_decisions  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TEMPS = (0.5, 1.0, 1.7, 1e-4, 0.0)  # 0: a greedy row, which the kernel leaves alone


def case(R: int, K: int, V: int, dtype: torch.dtype, seed: int, device: str = DEVICE, scale: float = 3.0):
    """Rows of logits, drafts (most the argmax, so that some are accepted), draft counts 0..K with padding zeroed,
    temperatures cycling through TEMPS, seeds and positions."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(R, K + 1, V, generator=g) * scale).to(dtype)
    drafts = torch.where(torch.rand(R, K, generator=g) < 0.7, logits.float().argmax(-1)[:, :K],
                         torch.randint(V, (R, K), generator=g))
    nd = torch.randint(K + 1, (R,), generator=g)
    drafts = torch.where(torch.arange(K)[None, :] < nd[:, None], drafts, 0)
    temps = torch.tensor([TEMPS[i % len(TEMPS)] for i in range(R)])
    seeds, pos = torch.randint(2**62, (R,), generator=g), torch.randint(100_000, (R,), generator=g)
    return tuple(t.to(device) for t in (logits, drafts, nd, temps, seeds, pos))


@pytest.mark.parametrize("K, V, dtype", [(0, 100, torch.float32), (1, 3000, torch.bfloat16),
                                         (3, 257, torch.float32), (4, 64, torch.bfloat16),
                                         (2, 9000, torch.bfloat16)])  # (V over two BLOCKs, not a multiple)
def test_kernel_equals_reference(K, V, dtype):
    args = case(40, K, V, dtype, seed=K * 7 + V)
    acc, final = tempered_decisions_triton(*args)
    ref_acc, ref_final = tempered_decisions(*args)
    sampled = args[3] > 0
    assert acc[sampled].tolist() == ref_acc[sampled].tolist()
    assert final[sampled].tolist() == ref_final[sampled].tolist()
    assert (acc[~sampled] == 0).all() and (final[~sampled] == 0).all()  # greedy rows untouched (zeros)
    if K:  # the rows accept some drafts and reject others, so both draws (residual and bonus) are covered
        nd = args[2][sampled]
        assert acc[sampled].sum() > 0 and (acc[sampled] < nd).any()


@pytest.mark.parametrize("V, lo, hi", [(300, 0, 300), (9000, 4100, 4200), (9000, 5, 8995)])
def test_kernel_draws_from_filtered_logits(V, lo, hi):
    """`rejection_sampler._draw_filtered` passes the sampler's filtered logits (-inf outside top-k / top-p) at
    temperature 1 with no drafts: every draw lies in the kept set, as the reference's, also when whole blocks of
    the vocabulary are -inf (the kept ids within [lo, hi), here only in the second of two blocks)."""
    R = 48
    g = torch.Generator().manual_seed(V + lo)
    logits = torch.randn(R, 1, V, generator=g) * 2
    kept = torch.zeros(R, V, dtype=torch.bool)
    kept[:, lo:hi] = torch.rand(R, hi - lo, generator=g) < 0.05
    kept[torch.arange(R), torch.randint(lo, hi, (R,), generator=g)] = True  # at least one id per row
    logits = torch.where(kept[:, None], logits, float("-inf"))
    i64 = dict(dtype=torch.int64)
    args = (logits, torch.zeros(R, 0, **i64), torch.zeros(R, **i64), torch.ones(R),
            torch.randint(2**62, (R,), generator=g), torch.randint(1000, (R,), generator=g))
    args = tuple(t.to(DEVICE) for t in args)
    final = tempered_decisions_triton(*args)[1].cpu()
    assert final.tolist() == tempered_decisions(*args)[1].tolist()
    assert kept[torch.arange(R), final].all()


def test_tiny_temperature_accepts_the_draft_holding_all_the_mass():
    """At a tiny temperature every other exp() underflows to 0: the draft has p = 1 exactly, so it is accepted
    whatever the noise, and the bonus position's draw (also one id with all the mass) matches."""
    logits = torch.full((4, 2, 50), -30.0)
    logits[:, 0, 7] = logits[:, 1, 11] = 30.0
    drafts = torch.full((4, 1), 7)
    nd, temps = torch.ones(4, dtype=torch.int64), torch.full((4,), 1e-3)
    seeds, pos = torch.arange(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)
    args = tuple(t.to(DEVICE) for t in (logits, drafts, nd, temps, seeds, pos))
    acc, final = tempered_decisions_triton(*args)
    assert acc.tolist() == [1] * 4
    assert final.tolist() == tempered_decisions(*args)[1].tolist() == [11] * 4


def test_dispatch_and_bad_layout():
    logits = torch.zeros(2, 3, 8, device=DEVICE)
    if DEVICE == "cuda":
        assert dispatch.tempered_decisions(logits) is tempered_decisions_triton
    else:
        assert dispatch.tempered_decisions(logits) is tempered_decisions
    i64 = dict(dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="expected logits with unit stride over V"):
        tempered_decisions_triton(logits.transpose(1, 2), torch.zeros(2, 7, **i64), torch.zeros(2, **i64),
                                  torch.ones(2, device=DEVICE), torch.zeros(2, **i64), torch.zeros(2, **i64))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("K", [0, 1, 2, 4])
def test_gpu_kernel_equals_reference_at_full_size(K):
    """The 8b-like model's vocabulary (131,072) in bf16, 64 rows: the decisions agree on all rows but where the
    noise falls within rounding of a threshold (at most 1 row in 64 here)."""
    args = case(64, K, 131072, torch.bfloat16, seed=K, scale=4.0)
    acc, final = tempered_decisions_triton(*args)
    ref_acc, ref_final = tempered_decisions(*args)
    sampled = args[3] > 0
    differ = ((acc != ref_acc) | (final != ref_final))[sampled]
    assert int(differ.sum()) <= 1, (acc[sampled].tolist(), ref_acc[sampled].tolist())
