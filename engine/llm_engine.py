"""The engine loop, one step per `step()` call: schedule -> launch -> read and update the previous step -> outputs.

A step is launched one of three ways (`_launch`); each is a case of the one loop, not a loop of its own:
- pipelined (K = 0, or a prefill-only engine): its committed tokens are accounted at launch
  (`StepUpdate.advance`), so with async scheduling the next call schedules and launches the next step while it
  runs, and only then reads it (`StepUpdate.resolve`): the host's work of one step overlaps the device's of the
  previous one; decode rows whose input is a token not read yet take it on the device;
- a whole-graph verify step (K > 0, async scheduling): how far it advances each row is known only once read; where
  the next step can only be the same rows verifying K drafts each (`Scheduler.chain`), that step is launched
  chained on its results on the device before it is read, and is the next call's step;
- synchronously (K > 0 otherwise): launched and read by the same call.
The steps launched and not read yet are the `StepPipeline`'s.
"""

from __future__ import annotations

import gc
import hashlib
import itertools
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from baton.engine.cache_pools import CachePools, plan_cache
from baton.engine.compile_watch import watch_compiles
from baton.engine.config import MOE, ModelConfig
from baton.engine.cuda_graphs import StepGraphs
from baton.engine.engine_config import EngineConfig
from baton.engine.grammar import Grammars
from baton.engine.kv_cache_dtype import bind_kv_scales, kv_scale_table, resolve_kv_dtype, split_kv_scales
from baton.engine.loader import load_checkpoint
from baton.engine.logits_processing import RowHistory
from baton.engine.logprobs import TokenLogprob, check_logprobs
from baton.engine.memory_budget import (
    CPU_CACHE_MEMORY_BYTES,
    CPU_MAX_NUM_SEQS,
    MemoryReport,
    auto_max_num_seqs,
    cache_budget,
    max_rows_cap,
)
from baton.engine.memory_budget import summary as budget_summary
from baton.engine.mixed_graph_buckets import MixedGraphBuckets
from baton.engine.model_family import model_class, mtp_class
from baton.engine.ops.kernels import resolve_kernels
from baton.engine.ops.linear.tuning import FUSED_GEMV_GPUS
from baton.engine.parallel.group import TPGroup, rank_device
from baton.engine.request import Request, RequestStatus
from baton.engine.runner import ModelRunner
from baton.engine.sampling_params import SamplingParams
from baton.engine.scheduler import Scheduler
from baton.engine.scheduler_output import SchedulerOutput, with_checkpoint_row
from baton.engine.spec_runner import SpecRunner
from baton.engine.step_pipeline import LaunchedStep, StepPipeline, last_chunk
from baton.engine.step_update import StepUpdate
from baton.engine.tokenizer import TextTokenizer, load_tokenizer
from baton.engine.warm_up import WarmUp, warm_up_prompt, warm_up_waves
from baton.engine.weights import TORCH_DTYPES

log = logging.getLogger("baton.engine")


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "prefilled" | None while running
    # A prefill-only request hands its caches over: its KV block ids and state slot, still allocated.
    held_block_ids: tuple[int, ...] = ()
    held_state_slot: int | None = None
    # Speculative decoding totals so far: draft tokens verified, and how many of them were accepted.
    num_drafted: int = 0
    num_accepted: int = 0
    # SamplingParams.logprobs: one per new token (None otherwise).
    logprobs: tuple[TokenLogprob, ...] | None = None
    # SamplingParams.prompt_logprobs: one per prompt token, None for the first (it has no context); in the
    # request's first output only.
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


# How a step ran (`EngineStats` counts each).
DECODE_GRAPH, MIXED_GRAPH, EAGER = "decode_graph", "mixed_graph", "eager"


def resolved_device(device: str) -> torch.device:
    """`EngineConfig.device`, "auto" decided: CUDA where a GPU is visible, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"engine field 'device': expected 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}: {e}"
                         ) from None


@dataclass
class EngineStats:
    steps: int = 0
    mixed_steps: int = 0      # steps whose batch held decode rows and prefill chunks together
    graph_steps: int = 0      # steps replayed as a CUDA graph of decode (verify) rows
    mixed_graph_steps: int = 0  # steps replayed as a CUDA graph of decode rows + one prompt chunk
    prompt_tokens: int = 0    # prefill tokens computed (recomputes after preemption included)
    decode_tokens: int = 0    # tokens fed by decode rows (the last token + drafts to verify)
    preemptions: int = 0
    step_seconds: float = 0.0
    # GPU time of the steps read so far (CUDA events from each step's first queued work to its last; 0.0 on CPU):
    # against step_seconds, whether the GPU or the host sets the pace
    device_seconds: float = 0.0
    max_rows: int = 0
    row_kinds: list[tuple[int, int]] = field(default_factory=list)  # (decodes, prefills) per step
    spec_drafted: int = 0       # draft tokens verified
    spec_accepted: int = 0      # of those, accepted
    spec_verify_rows: int = 0   # verify rows that carried drafts
    # Prefix cache (`prefix_cache.py`), since start: prefill tokens of admitted requests and how many of them came
    # from the cache; checkpoints taken, held now and their bytes; blocks and checkpoints evicted.
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_checkpoints_taken: int = 0
    prefix_checkpoints: int = 0
    prefix_checkpoint_bytes: int = 0
    prefix_block_evictions: int = 0
    prefix_checkpoint_evictions: int = 0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify row (accepted drafts + 1); 0 without speculative decoding."""
        return (self.spec_accepted + self.spec_verify_rows) / self.spec_verify_rows if self.spec_verify_rows else 0.0


def resolved_fused_gemv_max_tokens(config: EngineConfig, device: torch.device) -> int:
    """`EngineConfig.fused_gemv_max_tokens`, its default (None) decided for the device: `FUSED_GEMV_GPUS`'s
    value for the GPU (by name), else 0."""
    if config.fused_gemv_max_tokens is not None:
        return config.fused_gemv_max_tokens
    if device.type != "cuda":
        return 0
    name = torch.cuda.get_device_name(device)
    return next((tokens for gpu, tokens in FUSED_GEMV_GPUS.items() if gpu in name), 0)


# The default mixed-step graph size (EngineConfig.mixed_graph_tokens = None): the prompt tokens a step with decode
# rows may carry and still replay a graph; it roughly doubled two aggregated replicas' goodput under a TPOT bound
# (benchmarks/RESULTS.md, "Serving").
AUTO_MIXED_GRAPH_TOKENS = 256


def resolved_mixed_graph_tokens(config: EngineConfig, device: torch.device, graphable: bool) -> int:
    """`EngineConfig.mixed_graph_tokens`, its default (None) decided: AUTO_MIXED_GRAPH_TOKENS (at most the step
    budget) where decode steps replay CUDA graphs and mixed ones can too (CUDA, `cuda_graphs` on, an engine that
    decodes, K = 0, `graphable`: capturable layers and the Triton kernels), else 0."""
    if config.mixed_graph_tokens is not None:
        return config.mixed_graph_tokens
    graphs = device.type == "cuda" and config.cuda_graphs and not config.prefill_only
    if not (graphs and graphable and not config.num_speculative_tokens):
        return 0
    return min(AUTO_MIXED_GRAPH_TOKENS, config.max_num_batched_tokens)


class LLMEngine:
    def __init__(self, model_cfg: ModelConfig, weights: dict[str, torch.Tensor],
                 config: EngineConfig | None = None, tp: TPGroup | None = None) -> None:
        """`tp`: this rank's tensor-parallel group where `config.tensor_parallel_size` > 1 (None: joined from the
        environment, `TPGroup.from_env`); every rank's engine is built with the same arguments otherwise."""
        self.config = config = config or EngineConfig()
        self.model_config = model_cfg
        self._arrivals = itertools.count()
        self._ids = itertools.count()
        dtype_name = model_cfg.torch_dtype if config.dtype == "auto" else config.dtype
        self.dtype = TORCH_DTYPES[dtype_name]
        self.ssm_dtype = TORCH_DTYPES[config.ssm_state_dtype or model_cfg.mamba_ssm_cache_dtype]
        self.max_model_len = config.max_model_len or model_cfg.max_position_embeddings
        if tp is None:
            tp = TPGroup.from_env(config.tensor_parallel_size, resolved_device(config.device))
        if tp.size != config.tensor_parallel_size:
            raise ValueError(f"engine field 'tensor_parallel_size': expected the group's size {tp.size}, got "
                             f"{config.tensor_parallel_size}")
        self.tp = tp
        device = rank_device(resolved_device(config.device), tp)
        k = config.num_speculative_tokens
        if k and model_cfg.num_nextn_predict_layers < 1:
            raise ValueError(f"engine field 'num_speculative_tokens': expected 0 for a checkpoint without MTP "
                             f"weights (num_nextn_predict_layers = 0), got {k}")
        # Free and total GPU memory before this engine's weights: what other processes hold is not ours to size
        # (blocks this process cached and no longer uses are returned first, so that they do not count as theirs).
        free_total, allocated = None, 0
        if device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
            free_total, allocated = torch.cuda.mem_get_info(device), torch.cuda.memory_allocated(device)
        self.kernels = resolve_kernels(config.kernels, device)
        group = tp if tp.size > 1 else None
        kv_scales, weights = split_kv_scales(weights)
        self.model = model_class(model_cfg).from_state_dict(model_cfg, weights, device, self.dtype, self.kernels,
                                                            group)
        self.mtp = mtp_class(model_cfg).from_state_dict(model_cfg, weights, device, self.dtype, self.kernels,
                                                        group) if k else None
        # This rank's shapes (its heads and channels: `parallel.shard_config`), which its caches hold.
        self.shard_config = self.model.cfg
        # The KV pool's dtype and, for FP8, every attention layer's K and V scales (`kv_cache_dtype`).
        self.kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, self.dtype, device, self.kernels.triton)
        self.kv_scales = None
        if self.kv_dtype != self.dtype:
            self.kv_scales = kv_scale_table(self.model, self.mtp, kv_scales, device)
        elif kv_scales:
            log.info("the checkpoint's %d KV-cache scales are unused: the KV cache is %s (--kv-cache-dtype auto)",
                     len(kv_scales), self.dtype)
        bind_kv_scales(self.model, self.mtp, self.kv_scales)
        # What start measured (None where the pools' size was given or on a CPU), and the graphs' memory once
        # `capture_graphs` ran.
        self.memory: MemoryReport | None = None
        self.graphs_bytes = 0
        if free_total is not None:
            weights_bytes = torch.cuda.memory_allocated(device) - allocated
            self.config = config = self._sized(config, device, free_total, weights_bytes)
        else:
            self.config = config = replace(
                config, device=str(device), max_num_seqs=config.max_num_seqs or CPU_MAX_NUM_SEQS,
                cache_memory_bytes=config.cache_memory_bytes or CPU_CACHE_MEMORY_BYTES)
        if tp.size > 1:
            # Every rank schedules alike only with the same pools: the smallest rank's budget (its GPU's free memory).
            # (A budget of None, where the pools' size was given in blocks, is None on every rank.)
            budget, seqs = tp.agree_min((config.cache_memory_bytes or 0, config.max_num_seqs))
            self.config = config = replace(config, cache_memory_bytes=budget or None, max_num_seqs=seqs)
        shard = self.shard_config
        self.plan = plan_cache(shard, self.model.state_spec(shard), config, self.dtype, self.ssm_dtype, self.kv_dtype)
        self.pools = CachePools(shard, self.plan, config.block_size, self.dtype, self.ssm_dtype, device, self.kv_dtype)
        graphable = self.graphs_capturable() and self.kernels.triton
        q = resolved_mixed_graph_tokens(config, device, graphable)
        if q != config.mixed_graph_tokens:  # the default decided: every part of the engine sees the value
            self.config = config = replace(config, mixed_graph_tokens=q)
        self.scheduler = Scheduler(config, self.plan.num_blocks, self.plan.num_slots, self.plan.num_checkpoints,
                                   self._prefix_seed())
        if self.scheduler.prefix is not None:
            log.info("%s", self.prefix_cache_summary())
        self.cache = self.scheduler.cache
        self.step_update = StepUpdate(self.scheduler)
        self.runner = self._make_runner(self.pools, device)
        self.fused_gemv_max_tokens = resolved_fused_gemv_max_tokens(config, device)
        self.runner.fused_gemv_max_tokens = self.fused_gemv_max_tokens
        self.runner.graphs = self._step_graphs(device)
        if self.runner.graphs is not None and config.mixed_graph_tokens and self.kernels.triton:
            self.runner.mixed_graphs = self.make_mixed_graphs(device)
        self.stats = EngineStats()
        self.last_step_rows = 0
        self.pipeline = StepPipeline()
        # Request id -> the request whose sampling state the runner holds under it: an id may be reused while a step
        # in flight still carries its last user, whose end must not drop the new request's state.
        self._owners: dict[str, Request] = {}
        self.pipelined = not k or config.prefill_only  # a step's committed tokens are known when it is launched
        # Steps left in flight when step() returns: 1 with async scheduling (with drafts: where a verify step can
        # be chained). Benchmarks set 0 between steps to time steps one at a time (the next step() then reads the
        # one in flight).
        self.depth = 1 if config.async_scheduling else 0

    def _prefix_seed(self) -> bytes:
        """The prefix cache's hash seed: what makes this engine's caches of a prefix differ from another model's
        (its shapes and weights' dtypes, and this rank's shard)."""
        ident = f"{self.shard_config!r}|{self.dtype}|{self.ssm_dtype}|{self.kv_dtype}|{self.config.block_size}"
        return hashlib.blake2b(ident.encode(), digest_size=16).digest()

    def prefix_cache_summary(self) -> str:
        """One line: the prefix cache's checkpoints, what each costs and where they are taken."""
        pc = self.scheduler.prefix
        if pc is None:
            return "prefix cache off"
        each = self.plan.checkpoint_bytes
        return (f"prefix cache: {pc.num_checkpoint_slots} state checkpoints of {each / 2**20:.2f} MiB each "
                f"({pc.num_checkpoint_slots * each / 2**20:.1f} MiB), one every "
                f"{self.config.prefix_checkpoint_stride} blocks ({pc.stride_tokens} tokens) of a prompt")

    def _make_runner(self, pools: CachePools, device: torch.device) -> ModelRunner:
        k = self.config.num_speculative_tokens
        if not k:
            return ModelRunner(self.model, pools, self.config.block_size, device)
        assert self.mtp is not None
        return SpecRunner(self.model, self.mtp, pools, self.config.block_size, device, k,
                          draft=not self.config.prefill_only)

    # ---- memory -----------------------------------------------------------------------------------
    def _sized(self, config: EngineConfig, device: torch.device, free_total: tuple[int, int],
               weights_bytes: int) -> EngineConfig:
        """`config` with the pools' budget and the running requests decided on CUDA (`memory_budget`): where
        `cache_memory_bytes` and `num_kv_blocks` are None the budget is what `gpu_memory_utilization` leaves after
        the weights and the activations and graphs measured here; `max_num_seqs` None: what that budget holds."""
        k = 0 if config.prefill_only else config.num_speculative_tokens
        cache = config.cache_memory_bytes
        if cache is None and config.num_kv_blocks is None:
            rows = config.max_num_seqs or max_rows_cap(config.max_num_batched_tokens, 1 + k)
            activations, graphs = self._measure_step_memory(config, device, rows)
            self.memory = MemoryReport(total=free_total[1], free=free_total[0], weights=weights_bytes,
                                       activations=activations, graphs=graphs)
            cache = cache_budget(self.memory, config.gpu_memory_utilization)
        seqs = config.max_num_seqs
        if seqs is None:
            if cache is None:  # the pools' size given in blocks: the CPU's default count
                seqs = CPU_MAX_NUM_SEQS
            else:
                unit = plan_cache(self.shard_config, self.model.state_spec(self.shard_config),
                                  replace(config, max_num_seqs=1, num_kv_blocks=1), self.dtype, self.ssm_dtype,
                                  self.kv_dtype)
                # Prefix checkpoints come one per state slot by default, else a given count out of the budget.
                ckpt = unit.checkpoint_bytes if config.enable_prefix_caching else 0
                given = config.prefix_checkpoint_slots or 0
                seqs = auto_max_num_seqs(cache - given * ckpt,
                                         unit.slot_bytes + unit.penalty_bytes + (0 if given else ckpt),
                                         unit.block_bytes, config.max_num_batched_tokens, 1 + k)
        return replace(config, device=str(device), cache_memory_bytes=cache, max_num_seqs=seqs)

    def _measure_step_memory(self, config: EngineConfig, device: torch.device, rows: int) -> tuple[int, int]:
        """(activations, graphs) in bytes, measured on throwaway pools of one request: the peak of a step of the
        largest prompt chunk (with a checkpoint row where the engine may run one; plus the logits that `rows` rows of
        1+K tokens sample), and, where graphs will run, their capture (`_measure_graphs`)."""
        k = 0 if config.prefill_only else config.num_speculative_tokens
        bs = config.block_size
        tokens = min(config.prefill_chunk_cap, config.max_num_batched_tokens, self.max_model_len - 2)
        probe = replace(config, max_num_seqs=1, cache_memory_bytes=None, enable_prefix_caching=False,
                        num_kv_blocks=-(-(tokens + 1) // bs) + config.num_speculative_tokens + 2)
        torch.cuda.synchronize(device)
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        plan = plan_cache(self.shard_config, self.model.state_spec(self.shard_config), probe, self.dtype,
                          self.ssm_dtype, self.kv_dtype)
        pools = CachePools(self.shard_config, plan, bs, self.dtype, self.ssm_dtype, device, self.kv_dtype)
        with_pools = torch.cuda.memory_reserved(device)
        runner = self._make_runner(pools, device)
        scheduler = Scheduler(probe, plan.num_blocks, plan.num_slots)
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        req = self._new_request([0] * (tokens + 1), params, "memory-profile", config.prefill_only)
        scheduler.add(req)
        runner.add_request(req.request_id, params)
        out = scheduler.schedule()
        graphable = self.graphs_capturable() and self.kernels.triton
        if (config.enable_prefix_caching and out.rows[0].num_tokens > 1
                and not resolved_mixed_graph_tokens(config, device, graphable)):
            # Such an engine may take a prefix checkpoint inside this chunk, its mixers running the chunk twice.
            out = with_checkpoint_row(out, pools.scratch_slot)
        runner.execute(out)
        torch.cuda.synchronize(device)
        logits = 0 if config.prefill_only else 2 * rows * (1 + k) * self.model_config.vocab_size * 4
        activations = max(0, torch.cuda.max_memory_reserved(device) - with_pools) + logits
        graphs = self._measure_graphs(config, device, pools, runner, rows)
        del runner, scheduler, pools, req
        gc.collect()
        torch.cuda.empty_cache()
        return activations, graphs

    def _measure_graphs(self, config: EngineConfig, device: torch.device, pools: CachePools, runner: ModelRunner,
                        rows: int) -> int:
        """The graphs' memory where they will run: every decode (verify) and mixed graph of up to `rows` rows,
        captured on `pools` as `capture_graphs` will capture them on the engine's (their padding rows touch only the
        scratch block and slot; what a graph holds does not depend on the pools' size). Measured, not estimated:
        the sizes share a pool, but each keeps its outputs and per-size inputs."""
        k = 0 if config.prefill_only else config.num_speculative_tokens
        graphable = self.graphs_capturable() and self.kernels.triton
        if not (config.cuda_graphs and not config.prefill_only and graphable):
            return 0
        bs = config.block_size
        torch.cuda.empty_cache()  # the profiled step's cached blocks are not the graphs'
        before = torch.cuda.memory_reserved(device)
        max_blocks = -(-self.max_model_len // bs) + k + 1
        step = StepGraphs(self.model, pools, bs, rows, max_blocks, device, tokens_per_row=1 + k,
                          replay=runner.replay, step_fn=runner.graph_step_fn if k else None)
        step.fused_gemv_max_tokens = resolved_fused_gemv_max_tokens(config, device)
        step.capture_all()
        q = resolved_mixed_graph_tokens(config, device, graphable)
        mixed = MixedGraphBuckets(self.model, pools, bs, rows, max_blocks - k, device, q) if q else None
        if mixed is not None:
            mixed.capture_all()
        torch.cuda.synchronize(device)
        return max(0, torch.cuda.memory_reserved(device) - before)  # `step` and `mixed` still hold their graphs here

    def memory_summary(self) -> str:
        """One line: where the memory went (on CUDA), and the running requests and context the pools allow."""
        device = torch.device(self.config.device)
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        report = self.memory
        if report is not None and self.graphs_bytes:
            report = replace(report, graphs=self.graphs_bytes)
        p = self.pools
        return budget_summary(name, report, p.kv.numel() * p.kv.element_size(), self.plan.num_blocks,
                              self.config.block_size, p.state_bytes(), self.plan.num_slots, self.max_model_len
                              ) + "; " + self.prefix_cache_summary()

    def _step_graphs(self, device: torch.device) -> StepGraphs | None:
        """CUDA graphs of decode steps (verify steps of 1+K tokens per row with speculative decoding), where
        they can run: on CUDA, with capturable layers. A prefill-only engine never decodes."""
        cfg = self.config
        if not cfg.cuda_graphs or device.type != "cuda" or cfg.prefill_only or not self.graphs_capturable():
            return None
        return self.make_step_graphs(device)

    def graphs_capturable(self) -> bool:
        """Whether a step's layers can be captured: on the Triton kernels every layer can (the fused MoE keeps its
        routing on the device); on the references no MoE layer (their expert loop reads routing decisions on the
        host), in the target or, with drafts, in the drafter (the verify graph holds its steps too)."""
        mc = self.model_config
        layers = mc.layer_types + (mc.mtp_layer_types if self.config.num_speculative_tokens else ())
        return MOE not in layers or self.kernels.triton

    def make_step_graphs(self, device: torch.device) -> StepGraphs:
        """The step graphs for this engine's shapes (on a CPU device they run their static layout eagerly)."""
        cfg = self.config
        k = cfg.num_speculative_tokens
        # Room for the longest sequence and a verify step's lookahead.
        max_blocks = -(-self.max_model_len // cfg.block_size) + k + 1
        # With K drafts the graph holds the whole verify step (SpecRunner.graph_step_fn).
        step_fn = self.runner.graph_step_fn if k else None
        graphs = StepGraphs(self.model, self.pools, cfg.block_size, cfg.max_num_seqs, max_blocks, device,
                            tokens_per_row=1 + k, replay=self.runner.replay, step_fn=step_fn)
        graphs.fused_gemv_max_tokens = self.fused_gemv_max_tokens
        return graphs

    def make_mixed_graphs(self, device: torch.device, buckets: tuple[int, ...] | None = None) -> MixedGraphBuckets:
        """The graphs of decode rows + one prompt chunk (EngineConfig.mixed_graph_tokens = Q), for chunks of each
        size of `buckets` (default `mixed_graph_buckets.bucket_sizes(Q)`); on a CPU device they run their static
        layout eagerly."""
        cfg = self.config
        max_blocks = -(-self.max_model_len // cfg.block_size) + 1
        return MixedGraphBuckets(self.model, self.pools, cfg.block_size, cfg.max_num_seqs, max_blocks, device,
                                 cfg.mixed_graph_tokens, buckets)

    def capture_graphs(self, sampled_verify: bool = True) -> int:
        """Capture the CUDA graph of every decode (verify) batch size now, and of every mixed step size with
        `mixed_graph_tokens`, as a server does before taking traffic, so that no request waits on a capture;
        returns how many were captured (0 without graphs). sampled_verify=False leaves out the verify graphs of
        rows that sample (a greedy benchmark's)."""
        mixed = self.runner.mixed_graphs
        graphs = self.runner.graphs
        device = torch.device(self.config.device)
        before = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
        n = (0 if graphs is None else graphs.capture_all(sampled_verify)) + (
            0 if mixed is None else mixed.capture_all())
        if device.type == "cuda":
            self.graphs_bytes += torch.cuda.memory_reserved(device) - before
        return n

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, config: EngineConfig | None = None) -> LLMEngine:
        config = config or EngineConfig()
        model_cfg, weights = load_checkpoint(model_dir, None if config.dtype == "auto" else config.dtype)
        engine = cls(model_cfg, weights, config)
        tokenizer = load_tokenizer(model_dir)
        if tokenizer is not None:
            engine.use_tokenizer(tokenizer)
        return engine

    def use_tokenizer(self, tokenizer: TextTokenizer) -> None:
        """The checkpoint's tokenizer, over whose vocabulary requests' grammars (`structured_output`) are matched."""
        cfg = self.model_config
        self.runner.grammars = Grammars(tokenizer.tokenizer.to_str(), cfg.vocab_size, cfg.eos_token_ids)

    def close(self) -> None:
        """Release what the engine holds beyond its memory: nothing at one rank (rank 0 of several stops the
        others, `parallel.leader`)."""

    # ---- requests ---------------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, prefill_only: bool = False) -> str:
        """Queue a request. `prefill_only`: compute the caches of all prompt tokens but the last (R1: the
        decode side computes token N from h(N-1)), never sample, and return the still-allocated block ids
        and state slot in its final output (free them with `free_held`)."""
        req = self._new_request(prompt_token_ids, params, request_id, prefill_only)
        self.scheduler.add(req)
        self._own(req)
        return req.request_id

    def _own(self, req: Request) -> None:
        self._owners[req.request_id] = req
        # A prefill-only request never samples: its grammar applies on the decode side, from its first token.
        params = replace(req.sampling, structured_output=None) if req.prefill_only else req.sampling
        self.runner.add_request(req.request_id, params,
                                RowHistory(req.prompt_token_ids, req.output_token_ids, req.stop_ids))

    def _forget(self, req: Request) -> None:
        """Drop the runner's sampling state of `req`, unless a newer request took its id since."""
        if self._owners.get(req.request_id) is req:
            del self._owners[req.request_id]
            self.runner.remove_request(req.request_id)

    def _new_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None,
                     prefill_only: bool) -> Request:
        cfg = self.model_config
        prompt = list(prompt_token_ids)
        if not prompt:
            raise ValueError("prompt_token_ids: expected at least one token, got an empty prompt")
        bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids: expected ids in [0, {cfg.vocab_size}), got {bad[:5]}")
        if prefill_only and len(prompt) < 2:
            raise ValueError(f"prompt_token_ids: expected at least 2 tokens for a prefill-only request (it computes "
                             f"all but the last), got {len(prompt)}")
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"prompt_token_ids: expected fewer than max_model_len={self.max_model_len} tokens, "
                             f"got {len(prompt)}")
        params.validate_for_vocab(cfg.vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            check_logprobs(name, getattr(params, name), self.config.max_logprobs)
        if params.structured_output is not None and not prefill_only and self.runner.grammars is None:
            raise ValueError("structured_output: expected an engine that knows its checkpoint's tokenizer "
                             "(tokenizer.json), got one without")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(cfg.eos_token_ids))
        return Request(request_id=request_id, prompt_token_ids=tuple(prompt), sampling=params,
                       arrival=next(self._arrivals), stop_ids=frozenset(stop), max_model_len=self.max_model_len,
                       prefill_only=prefill_only,
                       prompt_logprobs=None if params.prompt_logprobs is None else [None] * len(prompt))

    def abort(self, request_id: str) -> bool:
        req = self.scheduler.abort(request_id)
        if req is None:
            # A prefill-only request finishes when its last chunk is launched, but hands its caches over only
            # with that step's output: aborted in between, nobody will take them, so they are released here.
            req = self.pipeline.prefilled(request_id)
            if req is not None:
                self.scheduler.abort_prefilled(req)
        if req is not None:
            self._forget(req)
        return req is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.pipeline)

    def prefill_tokens_not_handed_back(self) -> int:
        """Prefill tokens (N-1 a prompt) of every prefill-only request not handed back yet: waiting, running, or
        finished by a step in flight (its output comes when that step is read). A router counts a prompt until
        its Prefill call returns: a count that dropped it at launch would disagree with it for two steps."""
        s = self.scheduler
        n = sum(r.num_tokens - 1 for r in s.waiting if r.prefill_only)
        n += sum(r.num_prefill_tokens for r in s.running if r.prefill_only)
        return n + self.pipeline.prefill_tokens_finished()

    # ---- the loop ---------------------------------------------------------------------------------
    def warm_up(self, everywhere: bool = False) -> WarmUp:
        """Run `warm_up.py`'s prompts through the real step path before serving, so that the prefill path's kernels
        (fresh and continued chunks, a prefix-cache hit) are compiled before the first request rather than inside
        its time to first token. They run on a scheduler of their own, and the engine's empty one comes back after:
        no block, checkpoint, counter or stat of theirs remains. Returns what ran: nothing where nothing compiles
        (off CUDA, the torch references; `everywhere` runs them there too) and at several ranks (their schedulers
        mirror the calls, not this one)."""
        device = torch.device(self.config.device)
        if self.config.tensor_parallel_size > 1 or not (everywhere or (device.type == "cuda" and self.kernels.triton)):
            return WarmUp()
        if self.has_unfinished():
            raise ValueError("warm-up: expected an idle engine, got requests in flight")
        live = (self.scheduler, self.cache, self.step_update, self.stats, self.pipeline)
        self.scheduler = Scheduler(self.config, self.plan.num_blocks, self.plan.num_slots, self.plan.num_checkpoints,
                                   self._prefix_seed())
        self.cache, self.step_update = self.scheduler.cache, StepUpdate(self.scheduler)
        self.stats, self.pipeline = EngineStats(), StepPipeline()
        pc = self.scheduler.prefix
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        n = 0
        # What the warm-up compiles is recorded; after it, each kernel specialization met is logged (a compile
        # inside some request's step) with how it differs from those met here.
        watch = watch_compiles() if device.type == "cuda" else None
        if watch is not None:
            watch.armed = False
        t0 = time.perf_counter()
        try:
            for wave in warm_up_waves(self.config.max_num_batched_tokens, self.max_model_len,
                                      pc.stride_tokens if pc is not None else None):
                for shared, own in wave:
                    self.add_request(warm_up_prompt(shared, own, self.model_config.vocab_size, n), params,
                                     request_id=f"warm-up-{n}", prefill_only=self.config.prefill_only)
                    n += 1
                while self.has_unfinished():
                    for out in self.step():
                        if out.held_state_slot is not None:
                            self.free_held(out.held_block_ids, out.held_state_slot)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if watch is not None:
                watch.armed = True
            ran = WarmUp(n, self.stats.steps, self.stats.prompt_tokens, pc.hit_tokens if pc is not None else 0,
                         time.perf_counter() - t0)
        finally:
            self.scheduler, self.cache, self.step_update, self.stats, self.pipeline = live
            self.last_step_rows = 0
        return ran

    def free_held(self, block_ids: tuple[int, ...] | list[int], state_slot: int) -> None:
        self.cache.free_held(block_ids, state_slot)

    def reserve(self, num_tokens: int) -> tuple[list[int], int] | None:
        """Blocks for `num_tokens` and a state slot for caches that a transfer will fill, or None if busy."""
        return self.cache.reserve(-(-num_tokens // self.config.block_size))

    def reserve_for(self, prompt_token_ids: list[int], num_tokens: int) -> tuple[list[int], int, int] | None:
        """As `reserve`, for a transfer of the prompt's first `num_tokens` tokens: the blocks the prefix cache holds
        for its first full blocks are taken as they are (one block is left to read at least), so that the transfer
        moves only the rest. (blocks, slot, how many leading blocks already hold their KV), or None if busy."""
        n = -(-num_tokens // self.config.block_size)
        pc = self.scheduler.prefix
        held = [] if pc is None or n < 2 else pc.held_prefix(prompt_token_ids[:num_tokens], n - 1)
        got = self.cache.reserve_after(held, n)
        return None if got is None else (got[0], got[1], len(held))

    def add_computed_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                             block_ids: list[int], state_slot: int, num_computed: int) -> str:
        """Admit a request whose first `num_computed` prompt tokens' KV and state already sit in
        `block_ids` / `state_slot` (pulled from a prefill node): its first step computes only the next
        token from that state (R1), inside whatever mixed batch runs then."""
        if params.prompt_logprobs is not None:
            raise ValueError(f"sampling field 'prompt_logprobs': expected None for a request whose prompt was "
                             f"computed elsewhere (the prefill node scores it), got {params.prompt_logprobs}")
        req = self._new_request(prompt_token_ids, params, request_id, prefill_only=False)
        self.scheduler.add_computed(req, block_ids, state_slot, num_computed)
        self.runner.reset_slot(state_slot)
        self._own(req)
        return req.request_id

    def step(self) -> list[RequestOutput]:
        """One engine step; returns an output for every request that got a token or finished.

        Schedules and launches a step (unless the last call chained this one), chains the next verify step on a
        verify step where it can only be that, then reads every step in flight but the newest `depth` pipelined
        ones (or the chained one): with async scheduling a pipelined step's outputs come from the next call."""
        t0 = time.perf_counter()
        pipe = self.pipeline
        launched = chained = None
        if pipe.chained is None:
            out = self.scheduler.schedule()
            if out.rows:
                launched = self._launch(out)
        current = pipe.newest
        if current is not None and current.flight is not None:
            current.drop_aborted(self.scheduler.requests)
            chained = self._chain(current) if self.depth else None
        keep = 1 if chained is not None else self.depth if launched is not None and self.pipelined else 0
        if self.runner.has_grammar():
            # A grammar's mask for a row's next token depends on the token before it, on the host: while any request
            # has one, every step is read before the next launch (async scheduling pauses; grammar rows are never
            # chained, `ModelRunner.processes`).
            keep = 0
        outputs: list[RequestOutput] = []
        read = 0
        while len(pipe.steps) > keep:
            done = pipe.steps.popleft()
            read += done.num_rows
            outputs += self._read(done, t0)
        if chained is not None:  # its rows: what schedule() gives now that the step it chains on is read
            chained.out = self.scheduler.chained_output(chained.flight.request_ids)
            chained.reqs = [self.scheduler.requests[r.request_id] for r in chained.out.rows]
        # Rows launched, else rows read: 0 only when nothing could run (waiting on blocks held elsewhere).
        self.last_step_rows = launched.num_rows if launched is not None else read
        if launched is not None and launched.pending is not None:
            # A pipelined step is accounted by the call that launches it (its emitted counts are known then).
            self._record(launched.out, time.perf_counter() - t0, {}, launched.path)
        return outputs

    def _launch(self, out: SchedulerOutput) -> LaunchedStep:
        """Queue `out` on the device: pipelined (accounted at once), as one whole-graph verify step, or
        synchronously (its result is there when this returns)."""
        reqs = [self.scheduler.requests[r.request_id] for r in out.rows]
        runner, prev, n = self.runner, self.pipeline.newest, len(out.rows)
        replays = self._replays()
        if self.pipelined:
            pending = runner.launch(out, None if prev is None else prev.pending)
            index = [len(req.output_token_ids) if row.sample else -1 for req, row in zip(reqs, out.rows, strict=True)]
            step = LaunchedStep(self.cache.step_launched(), out, reqs, self._path_since(replays), n, pending=pending,
                                index=index)
            self.step_update.advance(out)
        elif self.depth and isinstance(runner, SpecRunner) and runner.verify_graphable(out):
            # A whole verify step always replays its graph.
            step = LaunchedStep(self.cache.step_launched(), out, reqs, DECODE_GRAPH, n,
                                flight=runner.launch_verify(out))
        else:
            result = runner.execute(out)
            step = LaunchedStep(self.cache.step_launched(), out, reqs, self._path_since(replays), n, result=result)
        self.pipeline.steps.append(step)
        return step

    def _chain(self, done: LaunchedStep) -> LaunchedStep | None:
        """Launch the next verify step on `done`'s results on the device, before `done` is read, where it can
        only be that (`Scheduler.chain`); its rows are set once `done` is read."""
        ids = [r.request_id for r in done.out.rows]
        if self.runner.processes(ids) or self.runner.wants_logprobs(ids):
            return None
        plan = self.scheduler.chain(done.out)
        if plan is None:
            return None
        ids, slots, rooms, tables = zip(*plan, strict=True)
        flight = self.runner.launch_chained(done.flight, list(ids), list(slots), list(rooms), [list(t) for t in tables])
        step = LaunchedStep(self.cache.step_launched(), done.out, [], DECODE_GRAPH, len(flight.request_ids),
                            flight=flight)
        self.pipeline.steps.append(step)
        return step

    def _read(self, done: LaunchedStep, t0: float) -> list[RequestOutput]:
        """Wait for a launched step's tokens; update its requests with them and return their outputs."""
        if done.pending is not None:
            return self._read_pipelined(done)
        result = done.result if done.flight is None else self.runner.read_verify(done.flight)
        self.stats.device_seconds += result.device_seconds
        self.cache.step_done(done.step)
        before = [len(req.output_token_ids) for req in done.reqs]
        finished = self.step_update.update(done.out, result.sampled, result.drafts)
        if result.logprobs or result.prompt_logprobs:
            for req, n in zip(done.reqs, before, strict=True):
                _store_logprobs(req, result.logprobs.get(req.request_id), n, len(req.output_token_ids))
                _store_prompt_logprobs(req, result.prompt_logprobs.get(req.request_id))
        finished += self._grammars_complete(done.reqs)
        # Accounted when read: how many drafts each row accepted is known only now.
        self._record(done.out, time.perf_counter() - t0, result.sampled, done.path)
        for req in finished:
            self._forget(req)
        sampled = result.sampled
        return [self._output(req, n, len(req.output_token_ids), req.status.finished)
                for req, n in zip(done.reqs, before, strict=True) if req.request_id in sampled or req.status.finished]

    def _read_pipelined(self, done: LaunchedStep) -> list[RequestOutput]:
        """Write a pipelined step's tokens into its PENDING outputs (stop ids apply now); their outputs."""
        sampled, _ = done.pending.result()
        lps, prompt_lps = done.pending.read_logprobs()
        self.stats.device_seconds += done.pending.device_seconds()
        self.cache.step_done(done.step)
        outputs = []
        for row, req, index in zip(done.out.rows, done.reqs, done.index, strict=True):
            if prompt_lps:
                _store_prompt_logprobs(req, prompt_lps.get(row.request_id))
            if index >= 0:
                if not self.step_update.resolve(req, index, sampled[row.request_id]):
                    continue  # aborted, or stopped on an earlier token: this row's work is dropped
                if lps:
                    _store_logprobs(req, lps.get(row.request_id), index, index + 1)
                self._grammars_complete([req])
                finished = req.status.finished and index == len(req.output_token_ids) - 1
                outputs.append(self._output(req, index, index + 1, finished))
            elif req.status is RequestStatus.FINISHED_PREFILLED and last_chunk(row, req):
                outputs.append(self._output(req, 0, 0, True))
            else:
                continue
            if outputs[-1].finished:
                self._forget(req)
        return outputs

    def _grammars_complete(self, reqs: list[Request]) -> list[Request]:
        """Finish (stopped) the running requests whose grammar is complete: nothing but EOS could follow."""
        done: list[Request] = []
        if not self.runner.has_grammar():
            return done
        for req in reqs:
            if req.status is RequestStatus.RUNNING and self.runner.grammar_complete(req.request_id):
                self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
                done.append(req)
        return done

    @staticmethod
    def _output(req: Request, start: int, end: int, finished: bool) -> RequestOutput:
        """The output of a request whose tokens start..end-1 are new (its outputs up to end so far)."""
        status = req.status
        held = finished and status is RequestStatus.FINISHED_PREFILLED
        outputs = req.output_token_ids
        lps = None
        if req.sampling.logprobs is not None:
            lps = tuple(req.logprobs.pop(i, None) for i in range(start, end))
        prompt_lps = None
        if req.prompt_logprobs is not None and not req.prompt_logprobs_sent and (end > start or finished):
            prompt_lps = tuple(req.prompt_logprobs)
            req.prompt_logprobs_sent = True
        # RequestOutput(...) without its frozen __init__ (one object.__setattr__ per field: a third of a decode
        # step's output building at large batches); every field is given, so the instance is the same.
        o = object.__new__(RequestOutput)
        o.__dict__.update(
            request_id=req.request_id, prompt_token_ids=tuple(req.prompt_token_ids),
            token_ids=tuple(outputs[:end]), new_token_ids=tuple(outputs[start:end]),
            finished=finished, finish_reason=status.value if finished else None,
            held_block_ids=tuple(req.block_ids) if held else (),
            held_state_slot=req.state_slot if held else None,
            num_drafted=req.num_drafted, num_accepted=req.num_accepted, logprobs=lps, prompt_logprobs=prompt_lps)
        return o

    def _replays(self) -> tuple[int, int]:
        """The runner's decode-graph and mixed-graph replay counts (for `_path_since`)."""
        return self.runner.graph_steps, self.runner.mixed_graph_steps

    def _path_since(self, before: tuple[int, int]) -> str:
        """How the one step launched since `_replays()` returned `before` ran."""
        graphed, mixed = self._replays()
        return DECODE_GRAPH if graphed > before[0] else MIXED_GRAPH if mixed > before[1] else EAGER

    def _record(self, out: SchedulerOutput, seconds: float, sampled: dict, path: str) -> None:
        """Account one step, in the stats, with `path`, how it ran: counted with the step it belongs to, not when
        the runner launched it, so that no path's count runs ahead of `steps` (a chained verify step is launched
        one step before it is read)."""
        s = self.stats
        decode_tokens = 0
        for r in out.rows:
            if not r.is_decode:
                continue
            decode_tokens += len(r.token_ids)
            if r.num_draft:
                emitted = sampled.get(r.request_id, ())
                s.spec_verify_rows += 1
                s.spec_drafted += r.num_draft
                s.spec_accepted += len(emitted) - 1
        s.steps += 1
        s.mixed_steps += out.is_mixed
        s.graph_steps += path == DECODE_GRAPH
        s.mixed_graph_steps += path == MIXED_GRAPH
        s.decode_tokens += decode_tokens
        s.prompt_tokens += out.num_tokens - decode_tokens
        s.preemptions = self.scheduler.num_preemptions
        pc = self.scheduler.prefix
        if pc is not None:
            s.prefix_queried_tokens, s.prefix_hit_tokens = pc.queried_tokens, pc.hit_tokens
            s.prefix_checkpoints_taken, s.prefix_checkpoints = pc.checkpoints_taken, pc.num_checkpoints
            s.prefix_checkpoint_bytes = pc.num_checkpoints * self.plan.checkpoint_bytes
            s.prefix_block_evictions, s.prefix_checkpoint_evictions = pc.block_evictions, pc.checkpoint_evictions
        s.step_seconds += seconds
        s.max_rows = max(s.max_rows, len(out.rows))
        s.row_kinds.append((out.num_decodes, out.num_prefills))

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
                 ) -> list[RequestOutput]:
        """Serve all prompts together in this engine; results in input order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"params: expected one per prompt ({len(prompts)}), got {len(plist)}")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        done: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            outs = self.step()
            if not self.last_step_rows:
                raise RuntimeError("no request can be scheduled and nothing else will free room (a bug)")
            for o in outs:
                if o.finished:
                    done[o.request_id] = o
        return [done[i] for i in ids]


def _store_logprobs(req: Request, got: tuple[int, list[TokenLogprob]] | None, start: int, end: int) -> None:
    """Keep the logprobs of req's outputs start..end-1 (the tokens a step read now appended) until an output carries
    them: `got`'s first end - start entries (a verify row's positions past its emitted tokens are dropped)."""
    if got is not None:
        for i, item in enumerate(got[1][:end - start]):
            req.logprobs[start + i] = item


def _store_prompt_logprobs(req: Request, got: tuple[int, list[TokenLogprob]] | None) -> None:
    """Keep the prompt logprobs a step scored (from prompt index got[0] on)."""
    if got is not None and req.prompt_logprobs is not None:
        first, items = got
        req.prompt_logprobs[first:first + len(items)] = items
