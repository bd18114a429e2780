"""GPU by default: `--device auto`, the pools sized from the GPU's memory (`engine/memory_budget.py`), and the running
requests from what they hold. The GPU's memory report is faked here; benchmarks/RESULTS.md has the device's."""

from __future__ import annotations

import pytest
import torch

from baton.engine.engine_config import EngineConfig
from baton.engine.llm_engine import LLMEngine, resolved_device
from baton.engine.loader import load_checkpoint
from baton.engine.make_model import make_model
from baton.engine.memory_budget import (
    AUTO_MAX_NUM_SEQS,
    CPU_CACHE_MEMORY_BYTES,
    CPU_MAX_NUM_SEQS,
    GiB,
    MemoryReport,
    auto_max_num_seqs,
    cache_budget,
    summary,
)
from baton.engine.sampling_params import SamplingParams
from baton.node.engine_args import engine_config_from_args, parse_engine_flags

H200 = 140 * GiB


def test_the_pools_get_the_share_less_weights_activations_and_graphs():
    r = MemoryReport(total=H200, free=H200 - GiB, weights=16 * GiB, activations=3 * GiB, graphs=2 * GiB)
    assert cache_budget(r, 0.9) == int(0.9 * H200) - 21 * GiB
    assert cache_budget(r, 0.45) == int(0.45 * H200) - 21 * GiB


def test_a_share_that_does_not_fit_beside_other_processes_is_refused_saying_what_fits():
    # Another node on the GPU holds 64 GiB: 0.9 does not fit, 0.5 does.
    r = MemoryReport(total=H200, free=H200 - 64 * GiB, weights=16 * GiB, activations=GiB, graphs=0)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization.*0\.9 asks 126\.0 GiB.*expected at most 0\.54"):
        cache_budget(r, 0.9)
    assert cache_budget(r, 0.5) == int(0.5 * H200) - 17 * GiB


def test_a_share_that_leaves_nothing_for_the_pools_is_refused():
    r = MemoryReport(total=24 * GiB, free=24 * GiB, weights=16 * GiB, activations=3 * GiB, graphs=GiB)
    with pytest.raises(ValueError, match="leaves nothing for the KV and state pools"):
        cache_budget(r, 0.8)


@pytest.mark.parametrize("bad", [0, 1.5, -0.1, "0.9", True])
def test_the_utilization_is_a_fraction(bad):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=bad)


def test_running_requests_follow_the_state_pool_within_the_caps():
    slot, block = 100 * 2**20, 2**20
    # Plenty of memory: the cap, or as many rows of 1+K tokens as fill half the step budget (the rest for prompts).
    assert auto_max_num_seqs(80 * GiB, slot, block, 512, 1) == AUTO_MAX_NUM_SEQS
    assert auto_max_num_seqs(80 * GiB, slot, block, 512, 2) == 128
    assert auto_max_num_seqs(80 * GiB, slot, block, 512, 4) == 64
    # Little memory: the state pool takes at most half of the budget (a scratch slot aside).
    assert auto_max_num_seqs(4 * GiB, slot, block, 512, 1) == 2 * GiB // slot - 1 == 19
    # A model without Mamba layers has free slots.
    assert auto_max_num_seqs(GiB, 0, block, 512, 1) == AUTO_MAX_NUM_SEQS
    with pytest.raises(ValueError, match="expected room for one request's state"):
        auto_max_num_seqs(300 * 2**20, slot, block, 512, 1)


def test_the_startup_line_names_every_part():
    r = MemoryReport(total=H200, free=H200 - GiB, weights=16 * GiB, activations=3 * GiB, graphs=GiB // 2)
    line = summary("NVIDIA H200", r, kv_bytes=80 * GiB, num_blocks=1000, block_size=16, state_bytes=20 * GiB,
                   num_slots=200, max_model_len=8192)
    for part in ("NVIDIA H200", "weights 16.00 GiB", "activations 3.00 GiB", "CUDA graphs 512.0 MiB",
                 "KV 80.00 GiB (1000 blocks, 16000 tokens)", "state 20.00 GiB (200 slots)",
                 "up to 200 running requests", "context up to 8192 tokens", "1.0 GiB held by other processes"):
        assert part in line, (part, line)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    make_model(out, preset="tiny", seed=5, progress=False)
    return load_checkpoint(out)


def test_auto_is_the_cpu_without_a_gpu_with_the_cpu_sizes(tiny):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: auto is CUDA")
    assert resolved_device("auto") == torch.device("cpu")
    engine = LLMEngine(*tiny, EngineConfig(block_size=8, max_num_batched_tokens=64))
    c = engine.config
    assert (c.device, c.max_num_seqs, c.cache_memory_bytes) == ("cpu", CPU_MAX_NUM_SEQS, CPU_CACHE_MEMORY_BYTES)
    assert engine.memory is None and "engine on cpu" in engine.memory_summary()
    with pytest.raises(ValueError, match="engine field 'device'"):
        resolved_device("gpu0")


def test_the_engine_sizes_pools_and_requests_from_a_memory_report(tiny, monkeypatch):
    """`LLMEngine._sized` as it runs on CUDA, with the step's measurement and the GPU's report faked."""
    engine = LLMEngine(*tiny, EngineConfig(block_size=8, max_num_batched_tokens=64))
    seen = []

    def measured(config, device, rows):
        seen.append(rows)
        return 300 * 2**20, 100 * 2**20

    monkeypatch.setattr(engine, "_measure_step_memory", measured)
    total, others, weights = 8 * GiB, GiB, 2 * GiB
    cfg = engine._sized(EngineConfig(block_size=8, max_num_batched_tokens=64, gpu_memory_utilization=0.5),
                        torch.device("cpu"), (total - others, total), weights)
    assert seen == [32]  # graphs measured for the most rows an unset max_num_seqs may become
    assert cfg.cache_memory_bytes == 4 * GiB - weights - 400 * 2**20
    assert engine.memory == MemoryReport(total=total, free=total - others, weights=weights,
                                         activations=300 * 2**20, graphs=100 * 2**20)
    assert cfg.max_num_seqs == 32  # the tiny model's state slots are small: half the step budget caps
    # Given sizes win: no measurement; the requests then follow the given budget.
    seen.clear()
    given = engine._sized(EngineConfig(block_size=8, max_num_batched_tokens=64, cache_memory_bytes=2**26),
                          torch.device("cpu"), (total, total), weights)
    assert seen == [] and given.cache_memory_bytes == 2**26 and given.max_num_seqs == 32
    fixed = engine._sized(EngineConfig(block_size=8, max_num_batched_tokens=64, max_num_seqs=5, num_kv_blocks=40),
                          torch.device("cpu"), (total, total), weights)
    assert seen == [] and (fixed.max_num_seqs, fixed.cache_memory_bytes) == (5, None)
    # Not enough free beside other processes: refused at start with what fits.
    with pytest.raises(ValueError, match="expected at most 0.50"):
        engine._sized(EngineConfig(block_size=8, max_num_batched_tokens=64), torch.device("cpu"),
                      (total // 2, total), weights)


def test_the_flags_reach_the_engine_config():
    a = parse_engine_flags(["--gpu-memory-utilization", "0.45", "--device", "auto"], "test")
    c = engine_config_from_args(a)
    assert (c.gpu_memory_utilization, c.device, c.max_num_seqs, c.cache_memory_bytes) == (0.45, "auto", None, None)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        engine_config_from_args(parse_engine_flags(["--gpu-memory-utilization", "1.2"], "test"))


@pytest.mark.gpu
@pytest.mark.parametrize("k", [0, 2])
def test_gpu_default_engine_sizes_its_pools_within_the_share(tmp_path, k):
    """On a GPU with no size given: CUDA, pools from the share, and after the graphs are captured the process holds
    no more than its share (what the CUDA context takes lies outside torch's count)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = make_model(tmp_path / "m", "small", mtp_layers=1, seed=3, progress=False)
    # What an earlier test in this process still holds (its graphs' pools) counts as another process's here.
    held_before = torch.cuda.memory_reserved()
    engine = LLMEngine.from_pretrained(model, EngineConfig(num_speculative_tokens=k, gpu_memory_utilization=0.5))
    c, report = engine.config, engine.memory
    assert c.device == "cuda" and report is not None and c.cache_memory_bytes > 0.25 * report.total
    engine.capture_graphs()
    print(f"\nK={k}: {engine.memory_summary()}; graphs estimated {report.graphs / GiB:.2f} GiB, captured "
          f"{engine.graphs_bytes / GiB:.2f} GiB")
    held = torch.cuda.memory_reserved() - held_before
    assert held <= 0.5 * report.total + GiB // 4, (held / GiB, report)
    # The graphs were measured at start by capturing them on throwaway pools: the real capture holds the same.
    assert engine.graphs_bytes <= 1.05 * report.graphs + 2**26, (engine.graphs_bytes, report)
    out = engine.generate([[5, 6, 7, 8]] * 3, SamplingParams(max_tokens=8, ignore_eos=True))
    assert all(len(o.token_ids) == 8 for o in out)
