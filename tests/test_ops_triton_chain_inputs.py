"""Triton chain-inputs kernel (`ops.chain_inputs.kernel`) against the torch reference `chain_inputs`: the same
inputs for a verify step chained on the previous one's results, int for int.

Without CUDA the kernel runs under TRITON_INTERPRET=1 on CPU tensors; the `gpu` test runs it compiled.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first import of triton

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (the Makefile's CPU install lacks it)")
pytestmark = pytest.mark.interpreter  # CPU tensors through the interpreter; the `gpu` tests run compiled

from baton.engine.ops.chain_inputs.kernel import ROWS, chain_inputs_triton  # noqa: E402
from baton.engine.ops.chain_inputs.reference import chain_inputs  # noqa: E402
from baton.engine.ops.kernels import resolve_kernels  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BS, SCRATCH = 4, 3


def case(m: int, n: int, src: list[int], K: int, seed: int, device: str = DEVICE):
    """The previous step's packed results for graph size m (counts 1..T, tokens, drafts), its positions, and for the
    chained step's rows: rooms around their counts (some short of K drafts, some past), block tables covering
    every position they may take; outputs pre-filled with a sentinel (entries past the graph size stay)."""
    g = torch.Generator().manual_seed(seed)
    T = 1 + K
    counts = torch.randint(1, T + 1, (m,), generator=g)
    emitted = torch.randint(0, 50, (m, T), generator=g)
    drafts = torch.randint(0, 50, (m, K), generator=g)
    packed = torch.cat([counts, emitted.view(-1), drafts.view(-1), torch.full((5,), -9)])  # (trailing junk)
    base = torch.randint(0, 40, (m,), generator=g)
    rows = len(src)
    rooms = counts[src] + torch.randint(-2, K + 3, (rows,), generator=g)
    width = (40 + 2 * T) // BS + 2
    tables = torch.randperm(n * width + 50, generator=g)[:n * width].view(n, width) + 10
    out = dict(ids=torch.full((n * T + 3,), -7), slot_mapping=torch.full((n * T + 3,), -7),
               seq_lens=torch.full((n + 2,), -7), verify_base=torch.full((n + 2,), -7),
               num_tokens=torch.full((n + 2,), -7))
    args = dict(packed=packed, m=m, src=torch.tensor(src), rooms=rooms, base_src=base, tables=tables)
    to = lambda d: {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in d.items()}  # noqa: E731
    return to(args), to(out), T


@pytest.mark.parametrize("m, n, src, K", [
    (4, 4, [0, 1, 2, 3], 1),         # the same rows again
    (8, 8, [0, 1, 2, 3, 4], 2),      # the last rows finished: padding rows after the live ones
    (8, 4, [1, 3, 6], 3),            # rows dropped in between, a smaller graph
    (2, 1, [1], 4),
    (80, 40, list(range(0, 80, 2))[:37], 2),  # more rows than a program's tile
])
def test_chain_inputs_equal_reference(m, n, src, K):
    args, out, T = case(m, n, src, K, seed=m + n + K)
    ref = {k: v.clone() for k, v in out.items()}
    chain_inputs(**args, **ref, n=n, T=T, block_size=BS, scratch_block=SCRATCH)
    chain_inputs_triton(**args, **out, n=n, T=T, block_size=BS, scratch_block=SCRATCH)
    for name in out:
        assert torch.equal(out[name], ref[name]), name
    rows = len(src)
    # the reference by hand, one row: its last emitted token, its first k drafts at the positions after its count
    c = args["packed"][src[0]].item()
    k = min(K, max(0, args["rooms"][0].item() - c))
    assert ref["num_tokens"][0].item() == 1 + k and ref["verify_base"][0].item() == args["base_src"][src[0]].item() + c
    assert ref["ids"][0].item() == args["packed"][m + src[0] * T + c - 1].item()
    assert ref["ids"][1:1 + k].tolist() == args["packed"][m + m * T + src[0] * K:][:k].tolist()
    assert ref["slot_mapping"][k + 1:T].tolist() == [SCRATCH * BS] * (T - 1 - k)
    # padding rows, and nothing past the graph size
    assert ref["num_tokens"][rows:n].tolist() == [T] * (n - rows) and ref["ids"][n * T:].tolist() == [-7] * 3
    assert ref["seq_lens"][n:].tolist() == [-7] * 2


def test_dispatch_and_tile_size():
    assert ROWS >= 8
    assert resolve_kernels("auto", "cuda" if torch.cuda.is_available() else "cpu").chain_inputs in (
        chain_inputs, chain_inputs_triton)


def test_bad_shapes_fail():
    args, out, T = case(4, 4, [0, 1], 1, seed=0)
    with pytest.raises(ValueError, match="rows"):
        chain_inputs_triton(**{**args, "rooms": args["rooms"][:1]}, **out, n=4, T=T, block_size=BS, scratch_block=0)
    with pytest.raises(ValueError, match="int64"):
        chain_inputs(**{**args, "src": args["src"].int()}, **out, n=4, T=T, block_size=BS, scratch_block=0)


@pytest.mark.gpu
def test_chain_inputs_compiled_equal_reference_at_256_rows():
    src = sorted(torch.randperm(256, generator=torch.Generator().manual_seed(1))[:200].tolist())
    args, out, T = case(256, 200, src, 3, seed=5, device="cuda")
    ref = {k: v.clone() for k, v in out.items()}
    chain_inputs(**args, **ref, n=200, T=T, block_size=BS, scratch_block=SCRATCH)
    chain_inputs_triton(**args, **out, n=200, T=T, block_size=BS, scratch_block=SCRATCH)
    for name in out:
        assert torch.equal(out[name], ref[name]), name
