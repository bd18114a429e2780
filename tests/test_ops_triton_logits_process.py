"""Triton logits-processing kernels (`ops.logits_process.kernel`) against the torch reference
`logits_processing.apply_processing`: the same logits (in the logits' dtype), bit for bit, over the cases
test_logits_processing.py covers (logit_bias, min_tokens, each penalty, min_p, greedy rows, verify rows whose
positions count the drafts before them, rows not processed), with the counts read from the host lists or resident
by slot, a grammar's masks, 16-bit logits and rows split over V.

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

from baton.engine.logits_processing import RowHistory, apply_processing, logits_inputs  # noqa: E402
from baton.engine.ops.kernels import resolve_kernels  # noqa: E402
from baton.engine.ops.logits_process.kernel import apply_processing_triton  # noqa: E402
from baton.engine.penalty_counts import PenaltyCounts  # noqa: E402
from baton.engine.rejection_sampler import RejectionSampler  # noqa: E402
from baton.engine.sampling_params import SamplingParams  # noqa: E402
from tests.test_logits_processing import PARAMS  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# PARAMS (bias, min_tokens, each penalty, min_p with penalties, nothing) and a greedy row with min_p and a penalty.
ROWS = [*PARAMS, SamplingParams(max_tokens=8, min_p=0.9, presence_penalty=0.5, logit_bias={7: 2.0})]


def _same_bits(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    differ = (got.view(bits) != want.view(bits)).nonzero()
    assert differ.numel() == 0, f"{len(differ)} logits differ, first at {differ[0].tolist()}"


def case(V: int, K: int, seed: int, rows=ROWS, device: torch.device = DEVICE, dtype=torch.float32, n_out: int = 3):
    """Histories whose outputs repeat tokens (counts of 2 and more), stop ids inside the vocabulary, drafts with a
    repeat and padding, draft counts 0..K."""
    g = torch.Generator().manual_seed(seed)
    hist = []
    for r in range(len(rows)):
        prompt = torch.randint(V, (7,), generator=g).tolist()
        outs = torch.randint(V, (r % n_out + 1,), generator=g).tolist()
        hist.append(RowHistory(prompt, [*outs, outs[0]], frozenset({0, V // 2, V - 1})))
    R = len(rows)
    logits = (torch.randn(R, K + 1, V, generator=g) * 3).to(dtype)
    drafts = torch.randint(V, (R, K), generator=g)
    if K > 1:
        drafts[:, 1] = drafts[:, 0]
    num_draft = torch.tensor([min(K, r % (K + 2)) for r in range(R)])
    return hist, logits.to(device), drafts.to(device), num_draft.to(device)


@pytest.mark.parametrize(("V", "K", "splits", "dtype"), [
    (300, 0, 1, torch.float32), (2500, 0, 3, torch.float32), (2500, 3, 2, torch.float32), (1100, 2, 1, torch.bfloat16),
])
def test_host_list_counts_give_the_references_bits(V, K, splits, dtype):
    hist, logits, drafts, num_draft = case(V, K, seed=V + K, dtype=dtype)
    inputs = logits_inputs(ROWS, hist, logits.device)
    want = apply_processing(logits, drafts, num_draft, inputs)
    _same_bits(apply_processing_triton(logits, drafts, num_draft, inputs, splits=splits), want, dtype)


@pytest.mark.parametrize(("K", "splits"), [(0, 2), (3, 1)])
def test_resident_counts_give_the_references_bits(K, splits):
    V = 2100
    hist, logits, drafts, num_draft = case(V, K, seed=K)
    pc = PenaltyCounts(len(ROWS) + 2, V, logits.device)
    slots = [4, 0, 6, 1, 7, 2, 3]
    owners = [i if p.penalised else None for i, p in enumerate(ROWS)]
    resident = pc.resident(slots, owners, hist, [p.repetition_penalty != 1 for p in ROWS])
    inputs = logits_inputs(ROWS, hist, logits.device, resident=resident)
    want = apply_processing(logits, drafts, num_draft, inputs)
    _same_bits(apply_processing_triton(logits, drafts, num_draft, inputs, splits=splits), want)
    # (the host lists process alike)
    _same_bits(want, apply_processing(logits, drafts, num_draft, logits_inputs(ROWS, hist, logits.device)))


def test_every_row_processed_a_grammar_and_min_tokens_at_verify_positions():
    V, K = 1500, 2
    rows = [SamplingParams(max_tokens=8, min_tokens=3, frequency_penalty=0.3, temperature=0.9, min_p=0.1),
            SamplingParams(max_tokens=8, repetition_penalty=0.7, logit_bias={0: 3.0, 1499: -2.5})]
    hist, logits, drafts, num_draft = case(V, K, seed=9, rows=rows, n_out=1)
    g = torch.Generator().manual_seed(3)
    words = -(-V // 32)
    masks = {1: torch.randint(-2 ** 31, 2 ** 31 - 1, (K + 1, words), generator=g, dtype=torch.int64)
             .to(torch.int32).numpy()}
    inputs = logits_inputs(rows, hist, logits.device, grammar=masks)
    assert inputs.min_tokens and inputs.grammar is not None and len(inputs.batch_rows) == 2
    want = apply_processing(logits, drafts, num_draft, inputs)
    _same_bits(apply_processing_triton(logits, drafts, num_draft, inputs, splits=2), want)
    assert torch.isinf(want[0, :2, 0]).all() and torch.isfinite(want[0, 2]).any()  # min_tokens' early positions


def test_the_triton_kernels_decide_the_references_tokens():
    V = 600
    rows = [SamplingParams(max_tokens=8, presence_penalty=1.5, logit_bias={5: 4.0}),
            SamplingParams(max_tokens=8, repetition_penalty=2.0), SamplingParams(max_tokens=8)]
    hist, logits, _, _ = case(V, 0, seed=4, rows=rows)
    inputs = logits_inputs(rows, hist, logits.device)
    kernels = resolve_kernels("triton", DEVICE)
    assert kernels.process_logits is apply_processing_triton
    assert resolve_kernels("torch", DEVICE).process_logits is apply_processing
    got = RejectionSampler(0, kernels).sample(logits[:, 0], rows, None, None, inputs)
    want = RejectionSampler(0, resolve_kernels("torch", DEVICE)).sample(logits[:, 0], rows, None, None, inputs)
    assert torch.equal(got, want)


def test_bad_inputs_are_refused():
    hist, logits, drafts, num_draft = case(64, 1, seed=0)
    inputs = logits_inputs(ROWS, hist, logits.device)
    with pytest.raises(ValueError, match="rows the inputs were built for"):
        apply_processing_triton(logits[:2], drafts[:2], num_draft[:2], inputs)
    with pytest.raises(ValueError, match="drafts"):
        apply_processing_triton(logits, drafts[:, :0], num_draft, inputs)
    with pytest.raises(ValueError, match="splits"):
        apply_processing_triton(logits, drafts, num_draft, inputs, splits=0)


@pytest.mark.gpu
@pytest.mark.parametrize("K", [0, 3])
def test_compiled_equal_reference_at_full_vocabulary(K):
    V = 131072
    rows = [ROWS[r % len(ROWS)] for r in range(64)]
    hist, logits, drafts, num_draft = case(V, K, seed=11, rows=rows, device=torch.device("cuda"),
                                           dtype=torch.bfloat16)
    inputs = logits_inputs(rows, hist, logits.device)
    want = apply_processing(logits, drafts, num_draft, inputs)
    got = apply_processing_triton(logits, drafts, num_draft, inputs)
    # min_p's threshold takes Triton's log: an id within its rounding of the threshold may be kept or dropped.
    kept = torch.isfinite(got) == torch.isfinite(want)
    assert kept.float().mean() > 1 - 1e-6
    both = torch.isfinite(got) & torch.isfinite(want)
    assert torch.equal(got[both], want[both])
