"""Run the same engine work on `tp` tensor-parallel ranks, one process each (gloo on CPU), and collect every rank's
results: what `tests/test_tensor_parallel.py` compares with one process's.

A `Job` names a checkpoint, an engine config and prompts; each rank builds its engine over the same group, computes
the prefill logits of the first prompt (one step of the engine's own runner) and generates greedily from all
prompts. Results come back per rank, so that a test can check that every rank agrees as well (R3 across ranks).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.multiprocessing as mp

from baton.engine.engine_config import EngineConfig
from baton.engine.llm_engine import LLMEngine
from baton.engine.loader import load_checkpoint
from baton.engine.parallel.group import TPGroup
from baton.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class Job:
    name: str
    model_dir: str
    prompts: tuple[tuple[int, ...], ...]
    max_tokens: int = 8
    engine: dict = field(default_factory=dict)  # EngineConfig fields


@dataclass(frozen=True)
class JobResult:
    prefill_logits: torch.Tensor  # [len(prompts[0]), V] float32
    tokens: tuple[tuple[int, ...], ...]
    num_drafted: tuple[int, ...]
    num_accepted: tuple[int, ...]


def prefill_logits(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    """Logits of every position of `prompt`, in one step of the engine's runner (then the request is dropped)."""
    rid = engine.add_request(prompt, SamplingParams(max_tokens=1))
    out = engine.scheduler.schedule()
    hidden, _ = engine.runner.forward_hidden(out)
    engine.abort(rid)
    return engine.model.logits(hidden)


def run_job(job: Job, tp: TPGroup) -> JobResult:
    cfg, weights = load_checkpoint(job.model_dir)
    config = EngineConfig(**{**job.engine, "tensor_parallel_size": tp.size, "dtype": "float32", "device": "cpu"})
    engine = LLMEngine(cfg, weights, config, tp=tp)
    logits = prefill_logits(engine, list(job.prompts[0]))
    outs = engine.generate([list(p) for p in job.prompts], SamplingParams(max_tokens=job.max_tokens, ignore_eos=True))
    return JobResult(logits, tuple(o.token_ids for o in outs), tuple(o.num_drafted for o in outs),
                     tuple(o.num_accepted for o in outs))


def _rank_main(rank: int, tp: int, init_file: str, jobs: list[Job], out_dir: str) -> None:
    torch.set_num_threads(1)  # tp processes share the machine's cores
    group = TPGroup.init(tp, rank, torch.device("cpu"), init_method=f"file://{init_file}")
    results = {job.name: run_job(job, group) for job in jobs}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


def run_ranks(jobs: list[Job], tp: int, work_dir: Path) -> list[dict[str, JobResult]]:
    """Every job on `tp` ranks in separate processes; per rank, job name -> its result."""
    work_dir.mkdir(parents=True, exist_ok=True)
    init_file = work_dir / "rendezvous"
    init_file.unlink(missing_ok=True)
    mp.spawn(_rank_main, args=(tp, str(init_file), jobs, str(work_dir)), nprocs=tp, join=True)
    return [torch.load(work_dir / f"rank{r}.pt", weights_only=False) for r in range(tp)]


def run_single(jobs: list[Job]) -> dict[str, JobResult]:
    """Every job in this process, without parallelism (the reference)."""
    return {job.name: run_job(job, TPGroup.single()) for job in jobs}
