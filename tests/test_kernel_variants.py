"""`benchmarks/kernel_variants.py`: the census of Triton kernel specializations in the interpreter sees what the
compiler specializes on (integers divisible by 16, 16-byte-aligned pointers, constexpr values), per phase; and after
the warm-up a multi-turn chat workload on the tiny models meets no kernel specialization the warm-up did not (on a
GPU each would be a compile inside some request's step)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from benchmarks.kernel_variants import Census, build_engine, census_run, main, watching  # noqa: E402
from benchmarks.multiturn_bench import Workload  # noqa: E402
from tests.test_prefix_cache import checkpoint_rows_of  # noqa: E402

pytestmark = pytest.mark.interpreter


@triton.jit
def _census_probe_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)


def test_census_sees_what_the_compiler_specializes_on():
    census = Census()
    x = torch.zeros(80)
    with watching(census):
        census.phase = "warm-up"
        _census_probe_kernel[(1,)](x, 32, BLOCK=64)
        _census_probe_kernel[(1,)](x, 48, BLOCK=64)  # also divisible by 16: the same specialization
        census.phase = "workload"
        _census_probe_kernel[(1,)](x, 33, BLOCK=64)
        _census_probe_kernel[(1,)](x[1:], 32, BLOCK=64)  # 4 bytes past an aligned start
        _census_probe_kernel[(1,)](x, 32, BLOCK=16)
    assert x[0].item() == 4 and x[1].item() == 5  # the launches ran
    warm, later = census.first_met_in("warm-up"), census.first_met_in("workload")
    assert len(warm) == 1 and len(later) == 3
    diffs = sorted(m.variant.differences(census.nearest_before(m))[0] for m in later)
    assert diffs == ["BLOCK: =64 -> =16", "n: i32 D -> i32", "x_ptr: *fp32 D -> *fp32"]


# The Gated DeltaNet model's kernels in the interpreter take about as long again: left to `-m slow` runs.
@pytest.mark.parametrize("preset", ["tiny", pytest.param("qwen3.5-tiny", marks=pytest.mark.slow)])
def test_a_multi_turn_workload_meets_nothing_the_warm_up_did_not(preset):
    """A prefill node's engine (prefix cache on, checkpoints every 2 blocks, chunks of 40 tokens) after its warm-up:
    conversations whose turns continue from cached prefixes, several at once, prompts of lengths the warm-up never
    ran, checkpoints taken inside chunks (checkpoint rows)."""
    engine = build_engine(preset, "prefill", ["--kernels", "triton", "--device", "cpu", "--block-size", "16",
                                              "--max-num-seqs", "16", "--max-num-batched-tokens", "40",
                                              "--max-model-len", "512", "--prefix-checkpoint-stride", "2"],
                          seed=0, progress=False)
    rows = checkpoint_rows_of(engine)
    w = Workload(conversations=2, turns=3, system_tokens=40, user_tokens=9, answer_min=3, answer_max=11,
                 concurrency=2, vocab_size=engine.model_config.vocab_size, seed=1)
    report = census_run(engine, w, "prefill")
    assert report.workload.turns == 6 and report.workload.hit_tokens > 0 and rows
    assert report.counts["warm-up"] > 0
    assert report.after == [], report.markdown()


def test_main_reports(capsys):
    with pytest.raises(SystemExit):
        main(["--role", "decode"])
    assert "invalid choice" in capsys.readouterr().err
