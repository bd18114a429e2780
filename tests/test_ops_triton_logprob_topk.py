"""Triton logprob-rows kernels (`ops.logprob_topk.kernel`) against the torch reference `logprobs.pack`: the
chosen token's logprob and the k best alternatives of each row, within float32 rounding (the normaliser's sum runs
in another order), on float32 and bf16 logits (ties), rows with most ids at -inf (a min_p mask), k = 0, rows split
over V with a last slice shorter than k.

Without CUDA the kernels run under TRITON_INTERPRET=1 on CPU tensors; the `gpu` test runs them compiled at a full
vocabulary.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first import of triton

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (the Makefile's CPU install lacks it)")
pytestmark = pytest.mark.interpreter  # CPU tensors through the interpreter; the `gpu` tests run compiled

from baton.engine.logprobs import pack  # noqa: E402
from baton.engine.ops.kernels import resolve_kernels  # noqa: E402
from baton.engine.ops.logprob_topk.kernel import MAX_K, pack_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def check(got: torch.Tensor, logits: torch.Tensor, tokens: torch.Tensor, k: int, atol: float = 2e-6) -> None:
    """got against pack's: the token and its logprob; the alternatives' logprobs, descending, and ids whose own
    reference logprobs are those (where values tie, any of the tied ids), each id once, ties by lowest id."""
    want = pack(logits, tokens, k)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert torch.equal(got[:, 0], want[:, 0])
    torch.testing.assert_close(got[:, 1:2 + k], want[:, 1:2 + k], rtol=0, atol=atol)
    ids = got[:, 2 + k:].long()
    lp = logits.float().log_softmax(-1)
    torch.testing.assert_close(lp.gather(1, ids), want[:, 2:2 + k], rtol=0, atol=atol)
    for r in range(got.shape[0]):
        assert len(set(ids[r].tolist())) == k, f"row {r}: an id twice"
        for j in range(k - 1):  # equal values: ascending ids
            if lp[r, ids[r, j]] == lp[r, ids[r, j + 1]]:
                assert ids[r, j] < ids[r, j + 1], (r, j)


@pytest.mark.parametrize(("L", "V", "k", "splits", "dtype"), [
    (3, 2500, 5, 3, torch.float32), (4, 2050, 5, 3, torch.bfloat16), (2, 3000, 20, 2, torch.float32),
    (3, 40, 0, 1, torch.float32), (2, 700, 1, 1, torch.bfloat16),
])
def test_packed_rows_match_the_reference(L, V, k, splits, dtype):
    g = torch.Generator().manual_seed(V + k)
    logits = (torch.randn(L, V, generator=g) * 3).to(dtype)
    logits[0, ::2] = float("-inf")
    logits[-1, 3:] = float("-inf")  # fewer finite ids than k: the rest are -inf, the lowest ids first
    tokens = torch.randint(V, (L,), generator=g)
    tokens[0] = 1
    tokens[-1] = 2
    logits, tokens = logits.to(DEVICE), tokens.to(DEVICE)
    got = pack_triton(logits, tokens, k, splits=splits)
    check(got.cpu(), logits.cpu(), tokens.cpu(), k)
    if k > 3:
        last = got[-1, 2 + k:].long().tolist()
        assert sorted(last[:3]) == [0, 1, 2] and last[3:] == list(range(3, k))  # the -inf ids, lowest first


def test_dispatch_a_wide_k_and_bad_inputs():
    assert resolve_kernels("triton", DEVICE).logprob_pack is pack_triton
    assert resolve_kernels("torch", DEVICE).logprob_pack is pack
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, MAX_K + 10, generator=g).to(DEVICE)
    tokens = torch.tensor([0, 5], device=DEVICE)
    assert torch.equal(pack_triton(logits, tokens, MAX_K + 1), pack(logits, tokens, MAX_K + 1))
    assert pack_triton(logits[:0], tokens[:0], 3).shape == (0, 8)
    with pytest.raises(ValueError, match="vocabulary"):
        pack_triton(logits, tokens, MAX_K + 11)
    with pytest.raises(ValueError, match="tokens"):
        pack_triton(logits, tokens[:1], 2)
    with pytest.raises(ValueError, match="splits"):
        pack_triton(logits, tokens, 2, splits=0)


@pytest.mark.gpu
def test_compiled_match_the_reference_at_full_vocabulary():
    g = torch.Generator().manual_seed(2)
    L, V, k = 256, 131072, 20
    logits = (torch.randn(L, V, generator=g) * 3).to(torch.bfloat16).cuda()
    tokens = torch.randint(V, (L,), generator=g).cuda()
    # The normaliser sums 131,072 exponentials in fp32 in another order than torch's: the logprobs of both sides
    # move by up to about sqrt(V) ulps of the normaliser.
    check(pack_triton(logits, tokens, k).cpu(), logits.cpu(), tokens.cpu(), k, atol=5e-5)
