"""Triton tempered-verify kernel (`ops.tempered_verify.kernel`) against the torch references
`tempered_verify.tempered_decisions` and `filtered_decisions`: the accepted counts and drawn tokens of rows
sampling at a temperature, without and with top-k / top-p.

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

import baton.engine.ops.tempered_verify.kernel as tv  # noqa: E402
from baton.engine.ops.kernels import resolve_kernels  # noqa: E402
from baton.engine.ops.tempered_verify.kernel import (  # noqa: E402
    MAX_SPLITS,
    auto_splits,
    filtered_decisions_triton,
    tempered_decisions_triton,
    usable_sms,
)
from baton.engine.ops.tempered_verify.reference import filtered_decisions, tempered_decisions  # noqa: E402

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


FILTERS = ((0, 1.0), (3, 1.0), (1, 1.0), (0, 0.9), (0, 0.5), (5, 0.8), (0, 0.01), (40, 0.97), (-1, 1.0))


def filtered_case(R: int, K: int, V: int, dtype: torch.dtype, seed: int, device: str = DEVICE, scale: float = 3.0):
    """`case`'s rows with top-k / top-p cycling through FILTERS (top-k -1: V - 1, a cut of one id), as
    (logits, drafts, nd, temps, top_k, top_p, seeds, pos)."""
    logits, drafts, nd, temps, seeds, pos = case(R, K, V, dtype, seed, device, scale)
    top_k = torch.tensor([(FILTERS[i % len(FILTERS)][0]) % V for i in range(R)], device=device)
    top_p = torch.tensor([FILTERS[i % len(FILTERS)][1] for i in range(R)], device=device)
    return logits, drafts, nd, temps, top_k, top_p, seeds, pos


@pytest.mark.parametrize("K, V, dtype, scale", [(0, 100, torch.float32, 3.0), (1, 3000, torch.bfloat16, 3.0),
                                                (2, 257, torch.bfloat16, 0.3), (1, 9000, torch.bfloat16, 4.0),
                                                (3, 64, torch.float16, 1.0)])
def test_filtered_kernel_equals_reference(K, V, dtype, scale):
    """The bisection cut (`_cut`) keeps the ids the reference's stable sort keeps, ties (many in bf16 at scale
    0.3) by lowest id, so accept tests and draws agree on every sampled row."""
    args = filtered_case(60, K, V, dtype, seed=K * 11 + V, scale=scale)
    acc, final = filtered_decisions_triton(*args)
    ref_acc, ref_final = filtered_decisions(*args)
    sampled = args[3] > 0
    assert acc[sampled].tolist() == ref_acc[sampled].tolist()
    assert final[sampled].tolist() == ref_final[sampled].tolist()
    assert (acc[~sampled] == 0).all() and (final[~sampled] == 0).all()
    if K:
        nd = args[2][sampled]
        assert acc[sampled].sum() > 0 and (acc[sampled] < nd).any()


def test_shared_passes_equal_the_reference():
    """The split rows' code (`_share`'s barrier, the passes' partials combined, the draw's slice offsets), run by
    one program a row: the interpreter runs one program at a time, so several per row run on a GPU only
    (`test_gpu_split_rows_equal_reference`)."""
    args = filtered_case(24, 1, 9000, torch.bfloat16, seed=5)
    sampled = args[3] > 0
    for fn, a, ref in ((filtered_decisions_triton, args, filtered_decisions),
                       (tempered_decisions_triton, args[:4] + args[6:], tempered_decisions)):
        acc, final = fn(*a, splits=1)
        ref_acc, ref_final = ref(*a)
        assert acc[sampled].tolist() == ref_acc[sampled].tolist()
        assert final[sampled].tolist() == ref_final[sampled].tolist()
        assert (acc[~sampled] == 0).all() and (final[~sampled] == 0).all()


def test_bad_splits_are_refused():
    args = case(4, 1, 300, torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match=f"expected splits in 0..{MAX_SPLITS}, got 33"):
        tempered_decisions_triton(*args, splits=33)
    if DEVICE == "cuda":  # more programs than SMs: the first would wait on ones that never start
        n = torch.cuda.get_device_properties(0).multi_processor_count
        rows = n // 32 + 1
        with pytest.raises(ValueError, match=f"expected rows \\* splits within the {n} programs the GPU holds at once, "
                                             f"got {rows} \\* 32"):
            tempered_decisions_triton(*case(rows, 1, 300, torch.bfloat16, seed=0), splits=32)
    else:
        with pytest.raises(ValueError, match="expected splits 0 or 1 off a GPU, got 2"):
            tempered_decisions_triton(*args, splits=2)
        assert auto_splits(4, 131072, torch.device("cpu")) == 0


def test_split_rows_take_half_a_grid_the_gpu_refused(monkeypatch):
    """How many programs a row gets on a GPU (`auto_splits`, host arithmetic: no GPU needed): up to the SMs the
    process may use, and after the driver refused a cooperative grid, at most half of it; none where this Triton
    cannot launch a cooperative grid (forced splits are then refused)."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(tv, "_sm_count", lambda index: 132)
    monkeypatch.setattr(tv, "_REFUSED", {})
    assert tv.cooperative_launch()  # (this Triton's NVIDIA backend has the option)
    assert [tv.auto_splits(r, 131072, cuda) for r in (1, 4, 8, 33, 66, 67, 132)] == [32, 32, 16, 4, 2, 0, 0]
    assert tv.auto_splits(1, 9000, cuda) == 3  # one block of V a program at least
    tv._REFUSED[0] = 264  # e.g. 132 rows at 2 programs each, refused: 132 programs from then on
    assert [tv.auto_splits(r, 131072, cuda) for r in (1, 4, 8, 33, 66, 67)] == [32, 32, 16, 4, 2, 0]
    tv._REFUSED[0] = 130
    assert [tv.auto_splits(r, 131072, cuda) for r in (1, 4, 8, 33)] == [32, 16, 8, 0]
    with pytest.raises(ValueError, match="expected rows \\* splits within the 65 programs the GPU holds at once, "
                                         "got 33 \\* 2"):
        tv._check_splits(2, 33, 131072, cuda)
    monkeypatch.setattr(tv, "cooperative_launch", lambda: False)
    assert tv.auto_splits(1, 131072, cuda) == 0
    tv._check_splits(0, 8, 131072, cuda)
    with pytest.raises(ValueError, match="cannot launch a cooperative grid, got 2"):
        tv._check_splits(2, 8, 131072, cuda)


def test_split_rows_count_only_the_sms_an_mps_client_gets():
    assert usable_sms(132, None) == usable_sms(132, "") == usable_sms(132, "100") == 132
    assert usable_sms(132, "50") == 66 and usable_sms(132, " 12.5 ") == 16 and usable_sms(132, "0.1") == 1
    for bad in ("0", "150", "half", "-5"):
        with pytest.raises(ValueError, match=f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE: expected a number in \\(0, 100\\], "
                                             f"got '{bad}'"):
            usable_sms(132, bad)


def test_filtered_kernel_keeps_the_lowest_ids_of_a_tie_at_the_cut():
    """Ten ids tied at the top: top-k 3 keeps ids 0, 1, 2 of them (the stable sort's), and a draft among the
    others is never accepted."""
    R, V = 32, 50
    logits = torch.zeros(R, 2, V, dtype=torch.bfloat16)
    logits[:, :, 10:20] = 5.0
    drafts = torch.tensor([[10 + (i % 10)] for i in range(R)])
    args = (logits, drafts, torch.ones(R, dtype=torch.int64), torch.ones(R), torch.full((R,), 3),
            torch.ones(R), torch.arange(R, dtype=torch.int64), torch.zeros(R, dtype=torch.int64))
    args = tuple(t.to(DEVICE) for t in args)
    acc, final = filtered_decisions_triton(*args)
    ref_acc, ref_final = filtered_decisions(*args)
    assert acc.tolist() == ref_acc.tolist() and final.tolist() == ref_final.tolist()
    acc, final = acc.cpu(), final.cpu()
    assert (acc[drafts[:, 0] >= 13] == 0).all()
    assert set(final.tolist()) <= {10, 11, 12} and 0 < acc.sum() < R


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
        assert resolve_kernels("auto", logits.device).tempered_decisions is tempered_decisions_triton
    else:
        assert resolve_kernels("auto", logits.device).tempered_decisions is tempered_decisions
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("K", [0, 1, 3])
def test_gpu_filtered_kernel_equals_reference_at_full_size(K):
    """V = 131,072 in bf16, 72 rows with FILTERS' top-k / top-p: at most 1 row in 72 may differ by rounding."""
    args = filtered_case(72, K, 131072, torch.bfloat16, seed=K + 100, scale=4.0)
    acc, final = filtered_decisions_triton(*args)
    ref_acc, ref_final = filtered_decisions(*args)
    sampled = args[3] > 0
    differ = ((acc != ref_acc) | (final != ref_final))[sampled]
    assert int(differ.sum()) <= 1, (acc[sampled].tolist(), ref_acc[sampled].tolist())


def _in_chunks(fn, args: tuple, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fn over the rows of args (each [R, ...]) with `splits` programs a row, as many rows a launch as the SMs
    hold."""
    n = max(1, torch.cuda.get_device_properties(0).multi_processor_count // max(splits, 1))
    outs = [fn(*(t[i:i + n] for t in args), splits=splits) for i in range(0, args[0].shape[0], n)]
    return torch.cat([a for a, _ in outs]), torch.cat([f for _, f in outs])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("splits", [32, 7, 2])
@pytest.mark.parametrize("K", [0, 1, 3])
def test_gpu_split_rows_equal_reference(K, splits):
    """Several programs a row (slices of 4,096 ids: 32 of them; 7 slices of 20,480 ids, the last shorter; 2), V =
    131,072 in bf16, with and without top-k / top-p: as one program a row, at most 1 row in 72 may differ by
    rounding."""
    args = filtered_case(72, K, 131072, torch.bfloat16, seed=K + 200, scale=4.0)
    sampled = args[3] > 0
    for fn, a, ref in ((filtered_decisions_triton, args, filtered_decisions),
                       (tempered_decisions_triton, args[:4] + args[6:], tempered_decisions)):
        acc, final = _in_chunks(fn, a, splits)
        ref_acc, ref_final = ref(*a)
        differ = ((acc != ref_acc) | (final != ref_final))[sampled]
        assert int(differ.sum()) <= 1, (fn.__name__, acc[sampled].tolist(), ref_acc[sampled].tolist())
        assert (acc[~sampled] == 0).all() and (final[~sampled] == 0).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("splits", [32, 3])
def test_gpu_split_rows_keep_the_lowest_ids_of_a_tie_across_slices(splits):
    """12 ids tied at the top across the end of the first slice (4,096 ids with 32 slices, 45,056 with 3), 6 on
    each side: top-k 9 keeps the 9 lowest of them, 3 past the end, so every draw lands there and a draft among the
    others is never accepted."""
    R, V = 64, 131072
    start = (4096 if splits == 32 else 45056) - 6
    logits = torch.zeros(R, 2, V, dtype=torch.bfloat16, device="cuda")
    logits[:, :, start:start + 12] = 5.0
    drafts = torch.tensor([[start + (5 * i) % 12] for i in range(R)], device="cuda")
    i64 = dict(dtype=torch.int64, device="cuda")
    args = (logits, drafts, torch.ones(R, **i64), torch.ones(R, device="cuda"), torch.full((R,), 9, **i64),
            torch.ones(R, device="cuda"), torch.arange(R, **i64), torch.zeros(R, **i64))
    acc, final = _in_chunks(filtered_decisions_triton, args, splits)
    ref_acc, ref_final = filtered_decisions(*args)
    assert acc.tolist() == ref_acc.tolist() and final.tolist() == ref_final.tolist()
    assert (acc[drafts[:, 0] >= start + 9] == 0).all() and 0 < acc.sum() < R
    assert ((final >= start) & (final < start + 9)).all() and (final >= start + 6).any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("K", [0, 1])
def test_gpu_a_split_grid_the_gpu_cannot_hold_is_refused_not_left_waiting(K, monkeypatch):
    """A process that overrates the SMs it may use (an MPS share it cannot see, say) would launch more split
    programs than run at once, and the first would wait for ever on the others. The cooperative launch makes the
    driver refuse such a grid: forced splits are refused with a ValueError; with `auto` splits the rows are decided
    with one program each and the next launch takes at most half the refused grid, until one is held (a CUDA graph
    captured after such eager calls, as a capture's warm-up makes them, gets it). No hang, and the decisions
    equal the reference. (How many programs an SM holds depends on the kernel's registers: the driver decides.)"""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    monkeypatch.setattr(tv, "_REFUSED", {})
    monkeypatch.setattr(tv, "_sm_count", lambda index: 32 * sms)  # 32 programs an SM: more than any SM holds
    args = filtered_case(sms, K, 131072, torch.bfloat16, seed=300 + K, scale=4.0)
    ref_acc, ref_final = filtered_decisions(*args)
    sampled = args[3] > 0

    def check(acc, final):
        assert int(((acc != ref_acc) | (final != ref_final))[sampled].sum()) <= 1

    with pytest.raises(ValueError, match=f"the GPU refused {sms} \\* 32 programs at once"):
        filtered_decisions_triton(*args, splits=32)
    assert tv._REFUSED.get(0) == 32 * sms
    chosen = []
    for _ in range(6):
        before = tv._REFUSED.get(0)
        chosen.append(tv.auto_splits(sms, 131072, args[0].device))
        check(*filtered_decisions_triton(*args))
        if tv._REFUSED.get(0) == before:
            break  # held
        assert tv._REFUSED.get(0) == chosen[-1] * sms  # refused at the grid it chose: one program a row
    assert tv._REFUSED.get(0) == before, f"never held: {chosen}"  # (the loop ended on a launch the GPU held)
    assert chosen[:2] == [16, 8][:len(chosen)]  # halving from the refused 32 a row
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        acc, final = filtered_decisions_triton(*args)
    graph.replay()
    check(acc, final)


@pytest.mark.parametrize("K, V", [(0, 100), (2, 257), (1, 3000)])
def test_kernels_equal_the_reference_on_processed_logits_with_masked_ids(K, V):
    """Logits processing (`logits_processing`: min_p, min_tokens) hands the kernels float32 logits with -inf ids,
    the top one always finite: the kernels' decisions are still the reference's, and a masked id is never drawn
    or accepted (top-k asking for more ids than survive included)."""
    logits, drafts, nd, temps, top_k, top_p, seeds, pos = filtered_case(60, K, V, torch.float32, seed=K + V)
    g = torch.Generator().manual_seed(V)
    z = logits.float()
    # min_p's cut: ids below a random share of the row max's probability, at each position.
    keep = z >= z.amax(-1, keepdim=True) - torch.rand(z.shape[:2], generator=g).to(z.device)[..., None] * 4
    z = z.masked_fill(~keep, float("-inf"))
    sampled = temps > 0
    for got, want in ((tempered_decisions_triton(z, drafts, nd, temps, seeds, pos),
                       tempered_decisions(z, drafts, nd, temps, seeds, pos)),
                      (filtered_decisions_triton(z, drafts, nd, temps, top_k, top_p, seeds, pos),
                       filtered_decisions(z, drafts, nd, temps, top_k, top_p, seeds, pos))):
        assert got[0][sampled].tolist() == want[0][sampled].tolist()
        assert got[1][sampled].tolist() == want[1][sampled].tolist()
        at = got[0].clamp(max=K)[:, None, None].expand(-1, 1, V)
        final_ok = keep.gather(1, at).squeeze(1).gather(1, got[1][:, None]).squeeze(1)
        assert final_ok[sampled].all()
