"""benchmarks/step_profile.py: kernels of a decode step grouped by kind, read from the torch profiler's trace."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks import step_profile as sp  # noqa: E402


@pytest.mark.parametrize("name, kind", [
    ("_ssu_decode_kernel", "state update"),
    ("_conv_update_kernel", "conv"),
    ("_gated_rms_norm_kernel", "gated norm"),
    ("_rms_norm_kernel", "norm"),
    ("_relu2_kernel", "relu2"),
    ("_paged_attention_kernel", "attention"),
    ("_ssu_verify_kernel", "state update"),
    ("_record_kernel", "state update"),
    ("_write_kv_kernel", "kv write"),
    ("_ssd_output_kernel", "scan"),
    ("_gemv_kernel", "fused gemv"),
    ("_process_kernel", "sampling"),
    ("_slice_kernel", "sampling"),
    ("nvjet_tst_128x8_64x12_2x1_v_bz_splitK_TNT", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64_warpgroupsize1x1x1_execute_segment_k_off", "gemm"),
    ("void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128, 16, 4, 4, false, false>", "gemm"),
    ("Memcpy HtoD (Pinned -> Device)", "copy"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "other"),
    ("aten::linear", "gemm"),
    ("aten::index_put_", "other"),
])
def test_kernel_kinds(name, kind):
    assert sp.kind_of(name) == kind


def _event(name, cat, ts, dur, tid=1):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid}


def test_trace_kernels_gpu_and_cpu():
    trace = {"traceEvents": [
        _event("cudaGraphLaunch", "cuda_runtime", 0, 5),
        _event("_rms_norm_kernel", "kernel", 10, 2),
        _event("Memcpy DtoH", "gpu_memcpy", 20, 1),
        _event("nvjet_gemm", "kernel", 12, 30),
        {"ph": "i", "name": "marker", "ts": 1},
        # CPU ops: linear contains addmm (not counted twice); a second thread's op counts on its own.
        _event("aten::linear", "cpu_op", 100, 50),
        _event("aten::addmm", "cpu_op", 105, 40),
        _event("aten::mul", "cpu_op", 160, 3),
        _event("aten::add", "cpu_op", 110, 5, tid=2),
        _event("ProfilerStep", "user_annotation", 0, 500),
    ]}
    gpu = sp.trace_kernels(trace, gpu=True)
    assert [k.name for k in gpu] == ["_rms_norm_kernel", "nvjet_gemm", "Memcpy DtoH"]
    cpu = sp.trace_kernels(trace, gpu=False)
    assert [(k.name, k.dur_us) for k in cpu] == [("aten::linear", 50.0), ("aten::add", 5.0), ("aten::mul", 3.0)]


def test_profile_of_groups_per_step():
    ks = [sp.Kernel("nvjet_gemm", 0, 40.0), sp.Kernel("_rms_norm_kernel", 41, 2.0), sp.Kernel("nvjet_gemm", 50, 60.0),
          sp.Kernel("_rms_norm_kernel", 111, 2.0)]
    p = sp.profile_of(ks, batch=1, steps=2, wall_us=200.0, kind_bytes={"gemm": 5e6})
    assert p.wall_us_per_step == 100.0 and p.busy_us_per_step == 52.0 and p.idle_us_per_step == 48.0
    gemm, norm = p.rows
    assert (gemm.kind, gemm.kernels_per_step, gemm.us_per_step, gemm.share) == ("gemm", 1.0, 50.0, 0.5)
    assert gemm.gbps == pytest.approx(5e6 / 50.0 / 1e3)  # 5 MB in 50 µs = 100 GB/s
    assert (norm.kind, norm.us_per_step, norm.gbps) == ("norm", 2.0, None)
    assert p.top[0] == ("nvjet_gemm", 2, 50.0)
    with pytest.raises(ValueError, match="steps >= 1"):
        sp.profile_of(ks, batch=1, steps=0, wall_us=1.0)


def test_long_idle_stretches_are_counted_with_their_neighbours():
    """Gaps of GAP_MIN_US or more between merged kernels: a kernel overlapping a longer one (PDL) closes no gap;
    short gaps (launch latency) do not count."""
    ks = [sp.Kernel("a", 0.0, 100.0), sp.Kernel("b", 50.0, 10.0), sp.Kernel("c", 130.0, 10.0),
          sp.Kernel("d", 145.0, 5.0), sp.Kernel("e", 400.0, 1.0)]
    assert sp.gaps_of(ks, 20.0) == [sp.Gap(30.0, "a", "c"), sp.Gap(250.0, "d", "e")]
    assert sp.gaps_of(ks, 5.0)[1] == sp.Gap(5.0, "c", "d")
    p = sp.profile_of(ks, batch=1, steps=2, wall_us=401.0)
    assert (p.long_gaps_per_step, p.long_gap_us_per_step) == (1.0, 140.0)
    assert p.longest_gaps == ((250.0, "d", "e"), (30.0, "a", "c"))
    assert "idle stretches of 20 µs or more: 1.0 per step, 140 µs per step" in sp.table([p], {
        "device_name": "x", "commit": "c", "preset": "tiny", "context": 1, "copy_gbps": 1.0, "command": "cmd"})


def test_device_span_runs_from_the_first_start_to_the_last_end():
    """Overlapping kernels (PDL) and an early-ending long one: the span is max(end) - min(start), not a sum."""
    ks = [sp.Kernel("a", 100.0, 50.0), sp.Kernel("b", 120.0, 10.0), sp.Kernel("c", 140.0, 5.0)]
    assert sp.device_span_us(ks) == 50.0
    assert sp.device_span_us(ks[1:]) == 25.0
    with pytest.raises(ValueError, match="at least one kernel"):
        sp.device_span_us([])

def test_profile_of_rates_flops_where_known():
    ks = [sp.Kernel("nvjet_gemm", 0, 100.0), sp.Kernel("_ssd_state_kernel", 101, 20.0), sp.Kernel("x", 130, 5.0)]
    p = sp.profile_of(ks, batch=1, steps=1, wall_us=200.0, kind_flops={"gemm": 5e10, "scan": 1e9})
    rows = {r.kind: r for r in p.rows}
    assert rows["gemm"].tflops == pytest.approx(500.0)  # 5e10 FLOPs in 100 µs
    assert rows["scan"].tflops == pytest.approx(50.0)
    assert rows["other"].tflops is None and rows["gemm"].gbps is None


def test_prefill_shapes_parse_and_refuse_bad_ones():
    assert sp.prefill_shapes("1x8192, 4x2048") == [(1, 8192), (4, 2048)]
    assert sp.prefill_shapes("") == []
    for bad in ("8192", "0x16", "2x", "ax16", "2x-4"):
        with pytest.raises(SystemExit, match="PROMPTSxTOKENS"):
            sp.prefill_shapes(bad)


def test_smoke_prefill_run_on_cpu(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_profile.py"), "--smoke", "--no-progress",
                        "--prefill", "1x32,2x16", "--no-decode", "--steps", "2", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads((tmp_path / sp.JSON_NAME).read_text())
    assert [(p["prompts"], p["prompt_tokens"]) for p in data["profiles"]] == [(1, 32), (2, 32)]
    for p in data["profiles"]:
        gemm = next(row for row in p["rows"] if row["kind"] == "gemm")
        assert gemm["tflops"] > 0 and p["steps"] == 2
    assert "prefill 2 x 16 tokens" in r.stdout and "| TFLOP/s |" in r.stdout
    # Refusals are a SystemExit with a message (the process prints it and exits 1), checked in this process.
    with pytest.raises(SystemExit, match="--no-decode expected --prefill shapes"):
        sp.main(["--smoke", "--no-decode", "--prefill", ""])


def test_smoke_run_on_cpu(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_profile.py"), "--smoke", "--no-progress",
                        "--batches", "1,2", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads((tmp_path / sp.JSON_NAME).read_text())
    assert [p["batch"] for p in data["profiles"]] == [1, 2]
    for p in data["profiles"]:
        kinds = {row["kind"] for row in p["rows"]}
        assert "gemm" in kinds  # the linear layers ran
        assert p["busy_us_per_step"] > 0 and p["wall_us_per_step"] > 0 and p["weights_gbps"] > 0
    assert "| kind | kernels / step |" in r.stdout


def test_smoke_spec_run_on_cpu(tmp_path):
    """--spec K profiles verify steps of the preset with one MTP layer (spec_bench.py's engine)."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_profile.py"), "--smoke", "--no-progress",
                        "--batches", "2", "--spec", "2", "--out", str(tmp_path)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads((tmp_path / sp.JSON_NAME).read_text())
    assert data["meta"]["spec"] == 2 and [p["batch"] for p in data["profiles"]] == [2]
    assert "+ MTP, K = 2 (verify steps)" in r.stdout
    with pytest.raises(SystemExit, match=r"--spec profiles decode \(verify\) steps"):
        sp.main(["--smoke", "--spec", "1", "--prefill", "1x16"])
    with pytest.raises(SystemExit, match="expected no --fused-gemv-max-tokens"):
        sp.main(["--smoke", "--spec", "1", "--fused-gemv-max-tokens", "4"])
