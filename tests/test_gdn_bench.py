"""benchmarks/gdn_bench.py: its flags are checked, and without a GPU it says so (the run itself is GPU-only)."""

import pytest
import torch

from benchmarks import gdn_bench


@pytest.mark.parametrize("argv", [["--batches", "1,x"], ["--tokens", "0"], ["--graph-launches", "0"],
                                  ["--split-scan", "--solve-doubling"]])
def test_bad_flags_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as e:
        gdn_bench.main(argv)
    assert e.value.code == 2 and "expected" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_without_a_gpu_it_says_so(capsys):
    assert gdn_bench.main(["--tokens", "64"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.gpu
def test_a_short_run_compares_and_times(tmp_path):
    out = tmp_path / "gdn.json"
    assert gdn_bench.main(["--tokens", "512", "--batches", "1,8", "--graph-launches", "5", "--calls", "3",
                           "--json", str(out)]) == 0
    assert out.is_file()


@pytest.mark.gpu
def test_a_short_run_times_both_second_stages(tmp_path, capsys):
    out = tmp_path / "gdn.json"
    assert gdn_bench.main(["--tokens", "512", "--batches", "1", "--graph-launches", "5", "--calls", "3",
                           "--split-scan", "--split-sweep", "4096x4x2x8192x4", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "fused" in text and "split" in text and "split vs fused" in text
    assert out.is_file()


@pytest.mark.gpu
def test_a_short_run_times_both_inversions(capsys):
    assert gdn_bench.main(["--tokens", "512", "--batches", "1", "--graph-launches", "5", "--calls", "3",
                           "--solve-doubling"]) == 0
    text = capsys.readouterr().out
    assert "substitution" in text and "doubling" in text


@pytest.mark.gpu
def test_a_short_run_times_the_prep_pipelining(capsys):
    assert gdn_bench.main(["--tokens", "512", "--batches", "1", "--graph-launches", "5", "--calls", "3",
                           "--stages-sweep", "1x1,1x2,2x2"]) == 0
    text = capsys.readouterr().out
    assert "prep pipelining" in text and "| 2x2 |" in text


@pytest.mark.parametrize("sweep", ["4096", "4096x3", "4000x4", "ax4"])
def test_a_bad_decode_sweep_is_refused(sweep, capsys):
    with pytest.raises(SystemExit) as e:
        gdn_bench.main(["--decode-sweep", sweep])
    assert e.value.code == 2 and "--decode-sweep: expected" in capsys.readouterr().err


@pytest.mark.parametrize("flag,sweep", [("--wy-sweep", "8192x8x2"), ("--split-sweep", "4096x4x3x8192"),
                                        ("--split-sweep", "4096x4x0x8192x4"), ("--split-sweep", "ax4x3x8192x4"),
                                        ("--stages-sweep", "2"), ("--stages-sweep", "1x0")])
def test_a_bad_prefill_sweep_is_refused(flag, sweep, capsys):
    with pytest.raises(SystemExit) as e:
        gdn_bench.main([flag, sweep])
    assert e.value.code == 2 and f"{flag}: expected" in capsys.readouterr().err
