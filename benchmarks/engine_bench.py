"""Engine benchmarks (a) and (c) of issue #7, each against a limit measured in the same run.

(a) Decode step time at batch 1, 32, 256 against the traffic roofline. Bytes one decode step must move:

    weights    every parameter once (model dtype), lm_head included; of the embedding table only the B rows
               gathered (with tied embeddings the whole table, which the lm_head reads)
    SSM state  read + write, B x L_mamba x H x P x N x (pool dtype size)  (Gated DeltaNet: L_gdn x Hv x Dk x Dv)
    conv state read + write, B x L_mamba x conv_dim x (d_conv - 1) x (dtype size)
    KV read    every request's context (computed tokens) in every attention layer: ctx x L_attn x 2 x Hkv x D x size
    KV write   the new token's K and V: B x L_attn x 2 x Hkv x D x size
    MoE        of the routed experts only those the step's B tokens route to: with top-k of E experts, a fraction
               1 - (1 - k/E)^B of each layer's expert weights in expectation under uniform routing (random weights
               route near uniformly; a trained router's skew touches fewer, so this is the larger count); the
               rest (`inactive_experts`) is not counted

    roofline ms = bytes / (device-to-device copy bandwidth, bytes read + written, measured in the run).
    Activations and the [B, V] fp32 logits are not counted.

    Per batch size B: B prefill-only requests of `--context` tokens (untimed, R1: all but the last token),
    then the same B requests re-admitted with those caches (`add_computed_request`), so that every request
    enters decode with the same context; `--steps` untimed warm-up decode steps (Triton JIT per shape), then
    `--steps` timed engine steps as a server runs them: with async scheduling (the engine's default) each
    call launches step n+1 and then reads step n, with no sync in between. The step time (`step_ms`) is the
    steady state: on CUDA the device's time from the end of the first timed step to the end of the last,
    / (steps - 1), from events queued before each call (idle gaps between steps count); on the CPU (nothing
    queued) the run's wall time / steps. `step_ms_mean` is the run's wall time / steps on every device, which
    also holds the first step's launch latency (the device idles until it); then `--steps` steps one at a
    time (schedule -> launch -> read,
    synchronised around each step: `step_ms_one_at_a_time`, host and device time added up), and for the same
    batch the model forward + lm_head alone (`forward`, repeated on one built batch).

(c) Prefill tokens/s at `--prefill-tokens` tokens in one engine step (one prompt, and also N prompts of
    tokens/N with `--prefill-splits`), after a warm-up of the same shape, against the bf16 matmul rate
    measured in the run (n x n x n `torch.matmul`, best of several). FLOPs of a step with rows of L_i tokens
    (T = sum L_i, R rows):

    2 x T x (matmul parameters of all layers; MoE experts x top_k / E)      linear layers
    + 2 x R x V x hidden                                                    lm_head on each row's last token
    + sum_attn_layers sum_i 4 x Hq x D x L_i (L_i + 1) / 2                  causal QK^T and PV
    + L_mamba x T x (4 H P N + (Q + 1)(G N + H P))                          SSD scan, chunk size Q, G groups:
      chunk states (B^T x) and their read-out (C s): 2 H P N each; the causal in-chunk C B^T (G N (Q+1)) and
      its product with dt x (H P (Q+1)), counting the causal half of each Q x Q chunk.
    + L_gdn x T x Hv x (8 Dk Dv + 2 (Q + 1)(Dk + Dv))                       Gated DeltaNet, chunk Q (Qwen3.5):
      per value head the state's read-out by q and by k and its update and the WY form's k-products (2 Dk Dv
      each), the causal in-chunk q k^T, k k^T and their products with v (Q + 1 over two, 4 ways).
    Element-wise work (norms, conv1d, gating, softmax) is not counted. MFU = FLOP/s / measured matmul FLOP/s.
    Then a serving-like step (unless --no-prefill-continued): a prompt's last tokens/2 continuing after its first
    half (prefix KV and initial states, as a chunked prompt's later chunk) beside a fresh prompt of tokens/2;
    its tok/s against the one-prompt step's (a prefill node's steps mix such rows).

Mixed steps (unless --mixed-batch 0): `--mixed-batch` decode rows at `--context`, decode-only (CUDA-graphed where
    graphs run, then the same steps eager), then beside a prompt's chunk of each `--mixed-prompt-tokens` size in
    every step: replayed as a CUDA graph where the engine's `--mixed-graph-tokens` covers the chunk, and eager.
    Per kind: wall ms per step with async scheduling and the median host ms of one step() call; host close to
    wall means the host, not the GPU, sets the step's length (what a decode node taking prompts, or an
    aggregated server's chunked prefill, pays per step).

FP8 against the model dtype (`--compare-fp8 VARIANTS`, e.g. `fp8-block,fp8,fp8-block+kv-fp8`): the preset in its
    dtype, then each variant: FP8 weights as `make-model --quantize fp8-block|fp8` writes them and the loader loads
    them (`fp8_checkpoint.quantize_state`, tensor by tensor; routed experts stay FP8 stacks, as from a
    checkpoint), and / or the KV pool in FP8 (`kv-fp8`: `--kv-cache-dtype fp8`, scales 1.0). Each engine is built,
    timed (decode at `--batches` as in (a), prefill of `--prefill-tokens` as in (c)) and freed before the next is
    built: a second model may not fit beside the first, so the run checks that the freed one is gone (no reference
    left, its CUDA memory returned) and stops otherwise. A variant that fails is recorded and the next one runs. The
    table: each step's ms per variant and its ratio to the model dtype's; the JSON is rewritten after each variant.

  python benchmarks/engine_bench.py --device cuda --out /tmp/engine          # 8b-like, one GPU (~45 GB)
  python benchmarks/engine_bench.py --device cuda --compare-fp8 fp8-block,fp8-block+kv-fp8 --out /tmp/fp8
  python benchmarks/engine_bench.py --smoke --out /tmp/engine                # tiny preset on the CPU, seconds
  python benchmarks/engine_bench.py --plot /tmp/engine/engine_bench.json     # PNG: step time vs batch + roofline
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import statistics
import sys
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

from baton.engine.cache_pools import CachePlan, plan_cache
from baton.engine.config import ATTENTION, MOE, ModelConfig
from baton.engine.engine_config import KV_CACHE_DTYPES, EngineConfig
from baton.engine.fp8_checkpoint import quantize_state
from baton.engine.kv_cache_dtype import FP8_KV_DTYPE
from baton.engine.layer_symbols import GDN, QWEN3_5, RECURRENT_SYMBOLS
from baton.engine.layers.fp8_linear import FP8Linear
from baton.engine.llm_engine import LLMEngine
from baton.engine.make_model import PRESET_NAMES, QUANTIZE_CHOICES, build_config, fp8_config, init_tensor
from baton.engine.model_family import model_class
from baton.engine.ops.fp8_linear.reference import FP8_DTYPE
from baton.engine.sampling_params import SamplingParams
from baton.engine.weights import FP32_SUFFIXES, TORCH_DTYPES, expected_weight_shapes

# `python benchmarks/X.py` puts only benchmarks/ on the path; the shared helpers are imported as a package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.run_info import device_name, git_commit  # noqa: E402

JSON_NAME = "engine_bench.json"
DECODE_GOALS = {1: 1.2, 256: 1.3}  # batch -> step / roofline goal (issue #7)
MFU_GOAL = 0.5
ACTIVATION_MARGIN = 4 * 2**30  # GPU memory left beside the weights and pools (`check_fits`)
MIXED_CHUNKS = 6  # chunks of the prompt timed beside the decode rows, per prompt size
# Linear layers (their FLOPs are counted for MFU).
_MATMUL_LEAVES = ("in_proj.weight", "out_proj.weight", "q_proj.weight", "k_proj.weight", "v_proj.weight",
                  "o_proj.weight", "up_proj.weight", "down_proj.weight", "experts.up_proj", "experts.down_proj",
                  "fc1_latent_proj.weight", "fc2_latent_proj.weight", "gate.weight", "eh_proj.weight",
                  # Qwen3.5
                  "in_proj_qkv.weight", "in_proj_z.weight", "in_proj_a.weight", "in_proj_b.weight",
                  "gate_proj.weight", "experts.gate_up_proj", "shared_expert_gate.weight")
# The embedding table of each family (only its gathered rows are read, unless the lm_head reads it).
_EMBEDDINGS = ("model.embeddings.weight", "model.embed_tokens.weight")


# ---- configuration ------------------------------------------------------------------------------------------

def check_device_and_preset(device: str, preset: str) -> None:
    if device not in ("cpu", "cuda"):
        raise ValueError(f"--device: expected cpu or cuda, got {device!r}")
    if preset not in PRESET_NAMES:
        raise ValueError(f"--preset: expected one of {', '.join(PRESET_NAMES)}, got {preset!r}")


@dataclass(frozen=True)
class BenchConfig:
    device: str = "cuda"
    preset: str = "8b-like"
    batches: tuple[int, ...] = (1, 32, 256)
    context: int = 1024           # prompt tokens per request before decode
    steps: int = 20               # timed decode steps (and as many warm-up steps)
    prefill_tokens: int = 8192    # tokens of the one prefill step of (c)
    prefill_splits: tuple[int, ...] = (1, 4)  # prompts sharing those tokens
    reps: int = 3                 # timed prefill steps per shape
    # Also time a serving-like prefill step: a prompt's last prefill_tokens/2 continuing after its first half
    # (prefix KV and initial states) beside a fresh prompt of prefill_tokens/2.
    prefill_continued: bool = True
    # Mixed steps: `mixed_batch` decode rows (0 = skip) alone (graphed, then eager) and beside a prompt's chunk of
    # each of `mixed_prompt_tokens` (graphed where `mixed_graph_tokens` covers it, and eager).
    mixed_batch: int = 64
    mixed_prompt_tokens: tuple[int, ...] = (128, 512)
    # The engine's mixed_graph_tokens: mixed steps of at most this many prompt tokens also replay a CUDA graph.
    mixed_graph_tokens: int = 512
    copy_mib: int = 1024          # device-to-device copy size for the bandwidth
    matmul_n: int = 8192          # n of the n x n x n matmul for the peak rate
    ssm_state_dtype: str | None = None  # None: the preset's mamba_ssm_cache_dtype
    fused_gemv_max_tokens: int | None = None  # the engine's (None: its default for the device)
    block_size: int = 16
    # FP8 weights as `make-model --quantize` writes them (None: the preset's dtype), and the KV pool's dtype.
    quantize: str | None = None
    kv_cache_dtype: str = "auto"
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        check_device_and_preset(self.device, self.preset)
        for name in ("mixed_batch", "mixed_graph_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"--{name.replace('_', '-')}: expected an integer >= 0, got {v!r}")
        for name in ("batches", "prefill_splits", "mixed_prompt_tokens"):
            v = getattr(self, name)
            if not v or any(not isinstance(b, int) or b < 1 for b in v):
                raise ValueError(f"--{name.replace('_', '-')}: expected positive integers, got {v!r}")
        for name in ("steps", "prefill_tokens", "reps", "copy_mib", "matmul_n", "block_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name.replace('_', '-')}: expected a positive integer, got {v!r}")
        # A prefill-only request computes all but its last token: it needs two at least.
        if self.context < 2:
            raise ValueError(f"--context: expected at least 2 tokens, got {self.context}")
        bad = [s for s in self.prefill_splits if self.prefill_tokens % s or self.prefill_tokens // s < 2]
        if bad:
            raise ValueError(f"--prefill-splits: expected divisors of --prefill-tokens={self.prefill_tokens} "
                             f"leaving >= 2 tokens per prompt, got {bad}")
        g = self.fused_gemv_max_tokens
        if g is not None and (not isinstance(g, int) or g < 0):
            raise ValueError(f"--fused-gemv-max-tokens: expected an integer >= 0, got {self.fused_gemv_max_tokens!r}")
        if self.ssm_state_dtype not in (None, "float32", "bfloat16", "float16"):
            raise ValueError(f"--ssm-state-dtype: expected float32, bfloat16 or float16, got {self.ssm_state_dtype!r}")
        if self.quantize not in (None, *QUANTIZE_CHOICES):
            raise ValueError(f"quantize: expected None or one of {', '.join(QUANTIZE_CHOICES)}, got {self.quantize!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: expected one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")


DEFAULTS = {
    "cuda": {"preset": "8b-like", "batches": "1,32,256", "context": 1024, "steps": 20, "prefill_tokens": 8192,
             "prefill_splits": "1,4", "reps": 3, "copy_mib": 1024, "matmul_n": 8192, "mixed_batch": 64,
             "mixed_prompt_tokens": "128,512", "mixed_graph_tokens": 512},
    "smoke": {"preset": "tiny", "batches": "1,4", "context": 24, "steps": 3, "prefill_tokens": 64,
              "prefill_splits": "1,4", "reps": 2, "copy_mib": 8, "matmul_n": 128, "mixed_batch": 3,
              "mixed_prompt_tokens": "4,8", "mixed_graph_tokens": 8},
}

# --compare-fp8 times decode and one prefill shape per variant: what the ratios need, no more.
COMPARE_DEFAULTS = {"prefill_splits": "1", "mixed_batch": 0, "mixed_graph_tokens": 0}


def _int_list(flag: str, text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated integers, got {text!r}") from None


# ---- measured limits ----------------------------------------------------------------------------------------

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], iters: int, device: torch.device) -> float:
    """Mean milliseconds per call of `fn` over `iters` back-to-back calls (CUDA events on the GPU)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e3 / iters


def copy_gbps(nbytes: int, device: torch.device, iters: int = 20) -> float:
    """Device-to-device copy bandwidth, GB/s of bytes read + written (as `kernels_bench.copy_gbps`)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    ms = time_ms(lambda: b.copy_(a), iters, device)
    return 2 * nbytes / (ms / 1e3) / 1e9


def matmul_tflops(n: int, dtype: torch.dtype, device: torch.device, iters: int = 10, reps: int = 5) -> float:
    """Best of `reps` runs of `iters` n x n x n matmuls: TFLOP/s (2 n^3 per matmul)."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, generator=g, device=device, dtype=dtype)
    b = torch.randn(n, n, generator=g, device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    for _ in range(3):
        torch.matmul(a, b, out=c)
    best = min(time_ms(lambda: torch.matmul(a, b, out=c), iters, device) for _ in range(reps))
    return 2 * n**3 / (best / 1e3) / 1e12


# ---- the model, in memory ------------------------------------------------------------------------------------

def random_weights(cfg: ModelConfig, hf: dict, device: torch.device, dtype: torch.dtype,
                   seed: int = 0, progress: bool = True, include_mtp: bool = False) -> dict[str, torch.Tensor]:
    """Random weights of `cfg` (its MTP layers only with `include_mtp`) drawn directly on `device`, as make_model
    draws them there."""
    shapes = expected_weight_shapes(cfg, include_mtp=include_mtp)
    out: dict[str, torch.Tensor] = {}
    for name, shape in tqdm(shapes.items(), desc="weights", unit="tensor", disable=not progress):
        want = torch.float32 if name.endswith(FP32_SUFFIXES) else dtype
        out[name] = init_tensor(name, shape, cfg, hf, seed, device).to(want)
    return out


def random_fp8_weights(cfg: ModelConfig, hf: dict, device: torch.device, dtype: torch.dtype, quantize: str,
                       seed: int = 0, progress: bool = True) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, canonical state) of `random_weights`' model written by `make-model --quantize QUANTIZE` and loaded
    back: each tensor drawn and stored in `dtype` as there, then quantized at once (`quantize_state`, one tensor at
    a time, so that the 16-bit model is never whole in memory beside its FP8 copy)."""
    shapes = expected_weight_shapes(cfg, include_mtp=False)
    qcfg = fp8_config(quantize, shapes)
    out: dict[str, torch.Tensor] = {}
    for name, shape in tqdm(shapes.items(), desc=f"weights ({quantize})", unit="tensor", disable=not progress):
        want = torch.float32 if name.endswith(FP32_SUFFIXES) else dtype
        t = init_tensor(name, shape, cfg, hf, seed, device).to(want)
        out.update(quantize_state(cfg, {name: t}, qcfg, dtype)[1])
    return replace(cfg, quantization=qcfg), out


@dataclass(frozen=True)
class Setup:
    """How big the engine is made: enough pools for the largest decode batch and for the prefill step."""
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    num_kv_blocks: int
    plan: CachePlan

    # Each pool holds one scratch entry past the plan's (CUDA-graph padding rows write there).
    @property
    def kv_bytes(self) -> int:
        return (self.plan.num_blocks + 1) * self.plan.block_bytes

    @property
    def state_bytes(self) -> int:
        return (self.plan.num_slots + 1) * self.plan.slot_bytes

    @property
    def penalty_bytes(self) -> int:
        """The penalty tables the plan sets aside beside the pools (`penalty_counts`)."""
        return (self.plan.num_slots + 1) * self.plan.penalty_bytes


def engine_setup(cfg: ModelConfig, bc: BenchConfig, dtype: torch.dtype, ssm_dtype: torch.dtype) -> Setup:
    bs = bc.block_size
    # Each decode request: its context, the first sampled token, warm-up + timed + forward-only steps.
    seq_len = bc.context + 2 * bc.steps + 4
    blocks_decode = max(bc.batches) * (-(-seq_len // bs) + 1)
    blocks_prefill = sum(-(-(bc.prefill_tokens // s) // bs) + 1 for s in bc.prefill_splits)
    if bc.prefill_continued:  # prompt A (head + tail) and two fresh ones of `tail`
        head, tail = continued_lengths(bc.prefill_tokens)
        blocks_prefill = max(blocks_prefill, -(-(head + tail) // bs) + 1 + 2 * (-(-tail // bs) + 1))
    # Mixed steps: B decode rows through warm-up, graphed, eager and mixed steps, beside one prompt at a time.
    mixed_len = bc.context + 4 * bc.steps + (MIXED_CHUNKS + 4) * len(bc.mixed_prompt_tokens) + 8
    mixed_prompt = (MIXED_CHUNKS + 1) * max(bc.mixed_prompt_tokens)
    if bc.mixed_batch:
        blocks_decode = max(blocks_decode, bc.mixed_batch * (-(-mixed_len // bs) + 1) + -(-mixed_prompt // bs) + 1)
    seqs = max(*bc.batches, *bc.prefill_splits, bc.mixed_batch + 1, 2)
    budget = max(bc.prefill_tokens, seqs, bc.mixed_batch + max(bc.mixed_prompt_tokens))
    max_len = max(seq_len, bc.prefill_tokens, *((mixed_len, mixed_prompt) if bc.mixed_batch else ())) + bs
    # No prefix cache: the timed prompts repeat (a hit would time nothing) and its checkpoints would take pool memory.
    probe = EngineConfig(block_size=bs, max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=max_len,
                         num_kv_blocks=max(blocks_decode, blocks_prefill), device=bc.device,
                         enable_prefix_caching=False)
    kv_dtype = FP8_KV_DTYPE if bc.kv_cache_dtype == "fp8" else dtype
    plan = plan_cache(cfg, model_class(cfg).state_spec(cfg), probe, dtype, ssm_dtype, kv_dtype)
    return Setup(max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=max_len,
                 num_kv_blocks=plan.num_blocks, plan=plan)


def engine_config(setup: Setup, bc: BenchConfig) -> EngineConfig:
    # cache_memory_bytes is what the pools and the penalty tables take; plan_cache derives the same block count from
    # it. No prefix cache: it would take checkpoints out of that budget and cut the measured prompt chunks, and the
    # prompts share nothing.
    return EngineConfig(block_size=bc.block_size, max_num_seqs=setup.max_num_seqs, enable_prefix_caching=False,
                        max_num_batched_tokens=setup.max_num_batched_tokens, max_model_len=setup.max_model_len,
                        cache_memory_bytes=setup.kv_bytes + setup.state_bytes + setup.penalty_bytes,
                        ssm_state_dtype=bc.ssm_state_dtype,
                        device=bc.device, fused_gemv_max_tokens=bc.fused_gemv_max_tokens,
                        mixed_graph_tokens=bc.mixed_graph_tokens, kv_cache_dtype=bc.kv_cache_dtype)


def check_fits(cfg: ModelConfig, setup: Setup, dtype: torch.dtype, device: torch.device) -> None:
    if device.type != "cuda":
        return
    torch.cuda.empty_cache()  # the copy and matmul buffers
    weights = sum(math.prod(s) for s in expected_weight_shapes(cfg, include_mtp=False).values()) * dtype.itemsize
    free, _ = torch.cuda.mem_get_info(device)
    need = weights + setup.kv_bytes + setup.state_bytes + setup.penalty_bytes
    # Leave room for the prefill step's activations, the CUDA graphs and the matmul buffers: no more, since the MoE
    # preset's weights and pools at the largest batch nearly fill an H100.
    if need > free - ACTIVATION_MARGIN:
        raise ValueError(f"GPU memory: expected weights + pools ({need / 2**30:.1f} GiB) to fit the free "
                         f"{free / 2**30:.1f} GiB minus {ACTIVATION_MARGIN / 2**30:.0f} GiB for activations; lower "
                         f"--batches or --context")


def build_engine(bc: BenchConfig) -> LLMEngine:
    """The real LLMEngine over an in-memory random model of the preset (no checkpoint on disk)."""
    device = torch.device(bc.device)
    hf = build_config(bc.preset)
    cfg = ModelConfig.from_hf_dict(hf)
    dtype = TORCH_DTYPES[cfg.torch_dtype]
    ssm_dtype = TORCH_DTYPES[bc.ssm_state_dtype or cfg.mamba_ssm_cache_dtype]
    setup = engine_setup(cfg, bc, dtype, ssm_dtype)
    check_fits(cfg, setup, dtype, device)
    if bc.quantize is None:
        weights = random_weights(cfg, hf, device, dtype, bc.seed, bc.progress)
    else:
        cfg, weights = random_fp8_weights(cfg, hf, device, dtype, bc.quantize, bc.seed, bc.progress)
    engine = LLMEngine(cfg, weights, engine_config(setup, bc))
    del weights  # the model holds its tensors; nothing else may keep them alive (`compare_fp8` frees the engine)
    if engine.plan != setup.plan:
        raise ValueError(f"cache plan: expected {setup.plan}, got {engine.plan}")
    return engine


# ---- (a) decode: traffic ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Traffic:
    """Bytes one decode step moves (KV read: mean over the timed steps)."""
    weights: int
    embedding_rows: int
    ssm_state: int
    conv_state: int
    kv_read: float
    kv_write: int
    inactive_experts: float = 0.0  # routed experts' bytes the step's tokens are not expected to route to

    @property
    def total(self) -> float:
        return (self.weights - self.inactive_experts + self.embedding_rows + self.ssm_state + self.conv_state
                + self.kv_read + self.kv_write)


def routed_expert(name: str) -> bool:
    """Whether canonical weight `name` is a routed expert's (stacked over experts; shared experts are not)."""
    return ".experts." in name


def inactive_expert_fraction(cfg: ModelConfig, tokens: int) -> float:
    """The expected fraction of each MoE layer's routed experts that `tokens` tokens do not route to, under uniform
    routing: (1 - k/E)^tokens (0 without MoE layers)."""
    if MOE not in cfg.layer_types:
        return 0.0
    return (1 - cfg.num_experts_per_tok / cfg.n_routed_experts) ** tokens


def weight_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """All parameters once, minus the embedding table unless the lm_head reads it (tied)."""
    return sum(_weight_bytes(cfg, dtype).values())


def _weight_bytes(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, int]:
    family = model_class(cfg)
    return {name: math.prod(shape) * (4 if family.runs_in_fp32(name) else dtype.itemsize)
            for name, shape in expected_weight_shapes(cfg, include_mtp=False).items()
            if not (name in _EMBEDDINGS and not cfg.tie_word_embeddings)}


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """K and V of one token in all attention layers."""
    return len(cfg.attention_layer_ids) * 2 * cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize


def decode_traffic(cfg: ModelConfig, dtype: torch.dtype, ssm_dtype: torch.dtype, batch: int,
                   context_tokens: float) -> Traffic:
    """context_tokens: the sum over the batch's requests of their computed tokens (KV read this step). The state
    bytes are the family's recurrent mixer's declared states (Mamba2 or Gated DeltaNet: `ssm` and `conv`)."""
    spec = model_class(cfg).state_spec(cfg)
    per_layer = {t.name: t.nbytes(dtype, ssm_dtype) for t in spec.states}
    ssm, conv = spec.num_layers * per_layer["ssm"], spec.num_layers * per_layer["conv"]
    per_weight = _weight_bytes(cfg, dtype)
    experts = sum(n for name, n in per_weight.items() if routed_expert(name))
    return Traffic(
        weights=sum(per_weight.values()),
        inactive_experts=experts * inactive_expert_fraction(cfg, batch),
        embedding_rows=0 if cfg.tie_word_embeddings else batch * cfg.hidden_size * dtype.itemsize,
        ssm_state=2 * batch * ssm,
        conv_state=2 * batch * conv,
        kv_read=context_tokens * kv_bytes_per_token(cfg, dtype),
        kv_write=batch * kv_bytes_per_token(cfg, dtype),
    )


def traffic_from_tensors(engine: LLMEngine, batch: int, context_tokens: float) -> Traffic:
    """The same bytes counted from the engine's real parameter and pool tensors (a check of the formula)."""
    model, pools, bs = engine.model, engine.pools, engine.config.block_size
    emb = model.input_embeddings().weight
    # The state dict: parameters and the weights held as buffers (the MoE router's correction bias).
    held = {name: t.numel() * t.element_size() for name, t in model.state_dict().items()}
    params = sum(held.values())
    experts = sum(n for name, n in held.items() if routed_expert(name))
    tied = model.lm_head is None
    kv_token = pools.kv[0, :pools.num_target_kv_layers].numel() * pools.kv.element_size() // bs
    return Traffic(
        weights=params - (0 if tied else emb.numel() * emb.element_size()),
        inactive_experts=experts * inactive_expert_fraction(engine.model.cfg, batch),
        embedding_rows=0 if tied else batch * emb[0].numel() * emb.element_size(),
        ssm_state=2 * batch * pools.states["ssm"][0].numel() * pools.states["ssm"].element_size(),
        conv_state=2 * batch * pools.states["conv"][0].numel() * pools.states["conv"].element_size(),
        kv_read=context_tokens * kv_token,
        kv_write=batch * kv_token,
    )


# ---- (a) decode: timing -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DecodeResult:
    batch: int
    context: int                  # prompt tokens per request
    steps: int
    mean_context_tokens: float    # per request, over the timed steps (computed tokens = KV read)
    step_ms_median: float
    step_ms_mean: float
    step_ms_min: float
    step_ms_one_at_a_time: float  # median, each step synchronised (no overlap of host and device)
    async_scheduling: bool        # whether step_ms_* are pipelined steps (the engine's default)
    step_ms_steady: float | None  # pipelined, CUDA: device time per step between the first and last timed step
    forward_ms: float             # model forward + lm_head on one decode batch, repeated
    copy_gbps: float
    traffic: Traffic
    traffic_from_tensors: Traffic

    @property
    def step_ms(self) -> float:
        """The engine's step time: with async scheduling the steady state (device-timed on CUDA, else wall time /
        steps), else the median synchronised step."""
        if not self.async_scheduling:
            return self.step_ms_median
        return self.step_ms_mean if self.step_ms_steady is None else self.step_ms_steady

    @property
    def roofline_ms(self) -> float:
        return self.traffic.total / (self.copy_gbps * 1e9) * 1e3

    @property
    def ratio(self) -> float:
        return self.step_ms / self.roofline_ms

    @property
    def forward_ratio(self) -> float:
        return self.forward_ms / self.roofline_ms

    @property
    def tokens_per_s(self) -> float:
        return self.batch / (self.step_ms / 1e3)


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Ids from 3 up: never pad / bos / eos.
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def _step(engine: LLMEngine, device: torch.device) -> tuple[list, float]:
    t0 = time.perf_counter()
    outs = engine.step()
    sync(device)
    if not engine.last_step_rows:
        raise RuntimeError("engine: no request could be scheduled (pools too small?)")
    return outs, (time.perf_counter() - t0) * 1e3


def enter_decode(engine: LLMEngine, batch: int, context: int, max_tokens: int, seed: int, device: torch.device,
                 progress: bool, temperature: float = 0.0, top_p: float = 1.0, sampling: SamplingParams | None = None,
                 tag: str = "") -> list[str]:
    """B requests of `context` prompt tokens, all in decode with the same context: prefill-only first (no
    decode rows run meanwhile), then re-admitted on their caches; their first step computes the last prompt
    token from h(N-1) (R1) and samples (greedy, or at `temperature` and `top_p`, each request seeded; or with
    `sampling`'s parameters, seeded, in place of those two). `tag` keeps the ids of several entries at one batch
    apart. Returns the request ids."""
    cfg = engine.model_config
    prompts = _prompts(batch, context, cfg.vocab_size, seed)
    if sampling is None:
        sampling = SamplingParams(temperature=temperature, top_p=top_p)
    params = [replace(sampling, max_tokens=max_tokens, ignore_eos=True,
                      seed=seed * 10007 + i if not sampling.greedy else None) for i in range(batch)]
    batch_tag = f"b{batch}{tag}"
    for i, p in enumerate(prompts):
        engine.add_request(p, params[i], request_id=f"{batch_tag}-p{i}", prefill_only=True)
    held: dict[str, tuple[tuple[int, ...], int]] = {}
    start = engine.stats.prompt_tokens
    with tqdm(total=batch * (context - 1), desc=f"prefill B={batch}", unit="tok", disable=not progress) as bar:
        while engine.has_unfinished():
            outs, _ = _step(engine, device)
            bar.update(engine.stats.prompt_tokens - start - bar.n)
            for o in outs:
                if o.finished:
                    held[o.request_id] = (o.held_block_ids, o.held_state_slot)
    ids = []
    for i, p in enumerate(prompts):
        blocks, slot = held[f"{batch_tag}-p{i}"]
        ids.append(engine.add_computed_request(p, params[i], f"{batch_tag}-d{i}", list(blocks), slot, context - 1))
    # With async scheduling the first token of a step comes back from the next step() call.
    first: set[str] = set()
    for _ in range(3):
        outs, _ = _step(engine, device)
        first |= {o.request_id for o in outs if o.new_token_ids}
        if len(first) == batch:
            return ids
    raise RuntimeError(f"first decode token: expected one for each of {batch} requests, got {len(first)}")


def _running_context(engine: LLMEngine) -> int:
    return sum(r.num_computed_tokens for r in engine.scheduler.running)


def forward_only_ms(engine: LLMEngine, iters: int, device: torch.device) -> float:
    """Model forward + lm_head of the batch the scheduler makes next, built once and run `iters` times.
    Prefill rows without an initial state recompute the same caches; decode rows advance their state
    again each time (the values do not matter here)."""
    out = engine.scheduler.schedule()
    runner = engine.runner
    with torch.inference_mode():
        input_ids, batch = runner.build_batch(out)
        last = batch.query_start_loc[1:] - 1

        def fwd() -> torch.Tensor:
            return engine.model.logits(engine.model(input_ids, batch)[last])

        for _ in range(2):
            fwd()
        sync(device)
        return time_ms(fwd, iters, device)


@contextlib.contextmanager
def one_step_at_a_time(engine: LLMEngine) -> Iterator[None]:
    """Steps read at once inside the block (no async scheduling); the engine's setting is restored after it. The
    first step() inside reads a step left in flight before."""
    depth, engine.depth = engine.depth, 0
    try:
        yield
    finally:
        engine.depth = depth


def _check_decode_step(engine: LLMEngine, batch: int) -> None:
    if engine.stats.row_kinds[-1] != (batch, 0):
        raise RuntimeError(f"decode step: expected {batch} decode rows and no prefill, "
                           f"got (decodes, prefills) = {engine.stats.row_kinds[-1]}")


def pipelined_step_times(engine: LLMEngine, batch: int, steps: int, device: torch.device,
                         contexts: list[int]) -> tuple[list[float], float, float | None]:
    """`steps` engine steps with async scheduling, as a server runs them (no sync between them: a call launches
    step n+1, then reads step n): (each call's ms, total ms / steps with one sync at the end, steady-state ms
    per step on CUDA else None). Appends the context (computed tokens) of each launched step to `contexts`.

    Steady state: an event queued before call i (i >= 1) fires when the device has finished the timed step
    launched by call i-1, one queued after the loop when it has finished the last; their span / (steps - 1)
    is the device's time per step, idle gaps between steps included, without the first launch's latency."""
    if steps < 2:
        raise ValueError(f"steps: expected at least 2 timed steps, got {steps}")
    gpu = device.type == "cuda"
    marks = []
    times = []
    sync(device)
    t_start = time.perf_counter()
    for i in range(steps):
        contexts.append(_running_context(engine))
        if gpu and i == 1:
            marks.append(torch.cuda.Event(enable_timing=True))
            marks[-1].record()
        t0 = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t0) * 1e3)
        _check_decode_step(engine, batch)
    if gpu:
        marks.append(torch.cuda.Event(enable_timing=True))
        marks[-1].record()
    sync(device)
    mean = (time.perf_counter() - t_start) * 1e3 / steps
    steady = marks[0].elapsed_time(marks[1]) / (steps - 1) if gpu else None
    return times, mean, steady


def bench_decode(engine: LLMEngine, bc: BenchConfig, batch: int, copy: float) -> DecodeResult:
    device = torch.device(bc.device)
    ids = enter_decode(engine, batch, bc.context, max_tokens=3 * bc.steps + 16, seed=bc.seed + batch,
                       device=device, progress=bc.progress)
    for _ in tqdm(range(bc.steps), desc=f"warm-up B={batch}", disable=not bc.progress):
        engine.step()
    contexts: list[int] = []
    pipelined, pipelined_mean, steady = pipelined_step_times(engine, batch, bc.steps, device, contexts)
    # The same steps one at a time (schedule -> launch -> read, synchronised around each step): the host's work
    # then adds to the device's instead of overlapping it.
    async_on = engine.depth > 0
    times = []
    with one_step_at_a_time(engine):
        engine.step()  # reads the step left in flight
        for _ in tqdm(range(bc.steps), desc=f"decode B={batch}", disable=not bc.progress):
            contexts.append(_running_context(engine))
            _, ms = _step(engine, device)
            _check_decode_step(engine, batch)
            times.append(ms)
        fwd = forward_only_ms(engine, bc.steps, device)
    for rid in ids:
        engine.abort(rid)
    ctx = statistics.fmean(contexts)
    dtype, ssm_dtype = engine.dtype, engine.ssm_dtype
    step_times = pipelined if async_on else times
    return DecodeResult(
        batch=batch, context=bc.context, steps=bc.steps, mean_context_tokens=ctx / batch,
        step_ms_median=statistics.median(step_times), step_ms_mean=pipelined_mean if async_on else statistics.fmean(times),
        step_ms_min=min(step_times), step_ms_one_at_a_time=statistics.median(times), async_scheduling=async_on,
        step_ms_steady=steady if async_on else None,
        forward_ms=fwd, copy_gbps=copy,
        traffic=decode_traffic(engine.model_config, dtype, ssm_dtype, batch, ctx),
        traffic_from_tensors=traffic_from_tensors(engine, batch, ctx))


# ---- (c) prefill ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Flops:
    linear: int
    lm_head: int
    attention: int
    ssd: int

    @property
    def total(self) -> int:
        return self.linear + self.lm_head + self.attention + self.ssd


def matmul_params_per_token(cfg: ModelConfig, tail: bool | None = None) -> int:
    """Weights a token multiplies in the layers (lm_head and embeddings apart; routed experts: top_k of E). tail
    True: only the tail's, which a prefill runs on its sampled tokens alone (the last cache-writing layer's output
    projection and every layer after it: `layers.norms.pre_norm_stack`); False: all but the tail's."""
    last = max(i for i, k in enumerate(cfg.layer_types) if k in (*RECURRENT_SYMBOLS, ATTENTION))
    total = 0
    for name, shape in expected_weight_shapes(cfg, include_mtp=False).items():
        if not name.startswith("model.layers.") or not name.endswith(_MATMUL_LEAVES):
            continue
        layer = int(name.split(".")[2])
        if cfg.family == QWEN3_5:  # decoder layer i holds blocks 2i (its token mixer) and 2i + 1 (its MLP)
            layer = 2 * layer + (".mlp." in name)
        in_tail = layer > last or (layer == last and name.endswith(("out_proj.weight", "o_proj.weight")))
        if tail is not None and in_tail != tail:
            continue
        n = math.prod(shape)
        if ".mixer.experts." in name or ".mlp.experts." in name:
            n = n * cfg.num_experts_per_tok // cfg.n_routed_experts
        total += n
    return total


def prefill_flops(cfg: ModelConfig, lengths: Sequence[int]) -> Flops:
    """FLOPs of one prefill step over fresh rows of these lengths, each sampling its last token: the layers' tail
    (`matmul_params_per_token`) on those last tokens only, as the engine runs it."""
    t = sum(lengths)
    h, p, n = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size
    q, g = cfg.chunk_size, cfg.n_groups
    hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    n_gdn = sum(k == GDN for k in cfg.layer_types)
    per_layer_attn = sum(4 * cfg.num_attention_heads * cfg.head_dim * L * (L + 1) // 2 for L in lengths)
    return Flops(
        linear=2 * (t * matmul_params_per_token(cfg, tail=False)
                    + len(lengths) * matmul_params_per_token(cfg, tail=True)),
        lm_head=2 * len(lengths) * cfg.vocab_size * cfg.hidden_size,
        attention=len(cfg.attention_layer_ids) * per_layer_attn,
        ssd=len(cfg.mamba_layer_ids) * t * (4 * h * p * n + (q + 1) * (g * n + h * p))
        + n_gdn * t * hv * (8 * dk * dv + 2 * (q + 1) * (dk + dv)),
    )


@dataclass(frozen=True)
class PrefillResult:
    prompts: int
    tokens: int
    reps: int
    step_ms_median: float
    step_ms_min: float
    forward_ms: float
    matmul_tflops: float
    flops: Flops

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / (self.step_ms_median / 1e3)

    @property
    def tflops(self) -> float:
        return self.flops.total / (self.step_ms_median / 1e3) / 1e12

    @property
    def mfu(self) -> float:
        return self.tflops / self.matmul_tflops

    @property
    def forward_mfu(self) -> float:
        return self.flops.total / (self.forward_ms / 1e3) / 1e12 / self.matmul_tflops


def _prefill_step(engine: LLMEngine, prompts: list[list[int]], tag: str, device: torch.device) -> float:
    """All prompts in one engine step (each samples one token and finishes): its milliseconds, the step read
    at once (no async scheduling: nothing else is in flight to overlap with)."""
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=f"{tag}-{i}")
    with one_step_at_a_time(engine):
        outs, ms = _step(engine, device)
    if engine.has_unfinished() or len(outs) != len(prompts):
        raise RuntimeError(f"prefill: expected {len(prompts)} prompts done in one step, "
                           f"got {len(outs)} (raise max_num_batched_tokens?)")
    return ms


def continued_lengths(tokens: int) -> tuple[int, int]:
    """(head, tail) of the continued prefill case: prompt A of head + tail tokens (= `tokens`) runs its head in one
    step beside a fresh prompt of `tail`, then its tail beside another fresh one: steps of `tokens` each."""
    return tokens - tokens // 2, tokens // 2


@dataclass(frozen=True)
class ContinuedPrefillResult:
    """The serving-like step of (c): `tail` tokens continuing a prompt after its first `head` (its KV and states
    as a prefix) plus a fresh prompt of `tail` tokens, against `PrefillResult`'s fresh rows."""
    head: int
    tail: int
    reps: int
    step_ms_median: float
    step_ms_min: float

    @property
    def tokens(self) -> int:
        return 2 * self.tail

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / (self.step_ms_median / 1e3)


def bench_prefill_continued(engine: LLMEngine, bc: BenchConfig) -> ContinuedPrefillResult:
    """Each rep: fresh prompt B0 (tail tokens) then prompt A (head + tail) for one step (B0 whole, A's head: the
    budget ends there; untimed), then fresh prompt B1 (tail) and one timed step: A's tail after its prefix, B1
    whole. Every prompt samples one token and finishes."""
    device = torch.device(bc.device)
    head, tail = continued_lengths(bc.prefill_tokens)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    times = []
    for r in tqdm(range(bc.reps + 1), desc=f"prefill {head}+{tail} and {tail}", disable=not bc.progress):
        a, b0, b1 = _prompts(3, head + tail, vocab, bc.seed + 104729 + r)
        with one_step_at_a_time(engine):
            engine.add_request(b0[:tail], params, request_id=f"c{r}-b0")
            engine.add_request(a, params, request_id=f"c{r}-a")
            outs, _ = _step(engine, device)
            if engine.stats.row_kinds[-1] != (0, 2) or len(outs) != 1 or not engine.has_unfinished():
                raise RuntimeError(f"continued prefill: expected B0 done and A's head in step 1, got "
                                   f"(decodes, prefills) = {engine.stats.row_kinds[-1]}, {len(outs)} done")
            engine.add_request(b1[:tail], params, request_id=f"c{r}-b1")
            outs, ms = _step(engine, device)
        if engine.has_unfinished() or len(outs) != 2:
            raise RuntimeError(f"continued prefill: expected A's tail and B1 in one step, got {len(outs)} outputs "
                               f"(raise max_num_batched_tokens?)")
        if r:  # the first is the warm-up
            times.append(ms)
    return ContinuedPrefillResult(head=head, tail=tail, reps=bc.reps, step_ms_median=statistics.median(times),
                                  step_ms_min=min(times))


# ---- mixed steps: decode rows beside a prompt's chunk ---------------------------------------------------------

@dataclass(frozen=True)
class MixedStep:
    """Steps of one kind: wall ms per step with async scheduling (run time / steps, one sync at the end) and the
    median host ms of one `engine.step()` call (the host's share: when it is close to the wall time, the host
    sets the pace, not the device)."""
    label: str
    decode_rows: int
    prompt_tokens: int  # per step (0: decode-only)
    graphed: bool
    steps: int
    step_ms: float
    host_ms: float


@dataclass(frozen=True)
class MixedResult:
    batch: int
    context: int
    rows: list[MixedStep]


def _timed_calls(engine: LLMEngine, device: torch.device, n: int,
                 check: Callable[[], None] | None = None) -> tuple[int, float, float]:
    """n engine.step() calls as a server makes them, `check()` after each: (calls, wall ms per call with one sync at
    the end, median host ms per call)."""
    host = []
    sync(device)
    t_start = time.perf_counter()
    while len(host) < n:
        t0 = time.perf_counter()
        engine.step()
        host.append((time.perf_counter() - t0) * 1e3)
        if check is not None:
            check()
    sync(device)
    return len(host), (time.perf_counter() - t_start) * 1e3 / len(host), statistics.median(host)


def bench_mixed(engine: LLMEngine, bc: BenchConfig) -> MixedResult:
    """B decode rows at `--context` (as in (a)): decode-only steps graphed (where graphs run) and eager, then with a
    prompt's chunk of P tokens beside them in every step (the scheduler's chunk cap set to P for the run; its
    first chunk untimed), for each P of `mixed_prompt_tokens`: replayed as mixed graphs where the engine has them
    for P tokens, and eager (the scheduler's one-chunk policy off: chunks of P even past `mixed_graph_tokens`).
    These rows say what a decode node that takes prompts, or an aggregated server, pays per step."""
    device = torch.device(bc.device)
    b = bc.mixed_batch
    ids = enter_decode(engine, b, bc.context, max_tokens=10**6, seed=bc.seed + 7919, device=device,
                       progress=bc.progress)
    for _ in range(bc.steps):
        engine.step()

    def decode_only() -> None:
        _check_decode_step(engine, b)

    graphed = engine.runner.graphs is not None
    rows = []
    n, ms, host = _timed_calls(engine, device, bc.steps, check=decode_only)
    rows.append(MixedStep("decode", b, 0, graphed, n, ms, host))
    if graphed:
        graphs, engine.runner.graphs = engine.runner.graphs, None
        try:
            _timed_calls(engine, device, 2, check=decode_only)  # warm-up
            n, ms, host = _timed_calls(engine, device, bc.steps, check=decode_only)
        finally:
            engine.runner.graphs = graphs
        rows.append(MixedStep("decode, eager", b, 0, False, n, ms, host))
    sched = engine.scheduler
    base = sched.config
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    mixed_graphs = engine.runner.mixed_graphs
    for i, p in enumerate(bc.mixed_prompt_tokens):
        # Graphed where the engine has mixed graphs for chunks of p tokens, then eager.
        for graphed in (True, False) if mixed_graphs is not None and p <= mixed_graphs.Q else (False,):
            rid = f"mixed-{p}-{graphed}"
            prompt = _prompts(1, (MIXED_CHUNKS + 1) * p, engine.model_config.vocab_size, bc.seed + 31 * i)[0]
            sched.config = replace(base, long_prefill_token_threshold=p,
                                   mixed_graph_tokens=base.mixed_graph_tokens if graphed else 0)
            engine.runner.mixed_graphs = mixed_graphs if graphed else None
            seen = [engine.stats.prompt_tokens]

            def mixed(p: int = p, seen: list[int] = seen) -> None:
                kinds, prompt_tokens = engine.stats.row_kinds[-1], engine.stats.prompt_tokens - seen[0]
                seen[0] = engine.stats.prompt_tokens
                if kinds != (b, 1) or prompt_tokens != p:
                    raise RuntimeError(f"mixed step: expected {b} decode rows and a prompt chunk of {p} tokens, got "
                                       f"(decodes, prefills) = {kinds} and {prompt_tokens} prompt tokens")

            try:
                engine.add_request(prompt, params, request_id=rid)
                _timed_calls(engine, device, 2)  # its first chunk (admission) and the step after: untimed
                seen[0] = engine.stats.prompt_tokens
                replays = engine.runner.mixed_graph_steps
                n, ms, host = _timed_calls(engine, device, MIXED_CHUNKS - 2, check=mixed)
                if engine.runner.mixed_graph_steps - replays != (n if graphed else 0):
                    raise RuntimeError(f"mixed steps of {p} tokens: expected {n if graphed else 0} mixed-graph replays, "
                                       f"got {engine.runner.mixed_graph_steps - replays}")
            finally:
                sched.config = base
                engine.runner.mixed_graphs = mixed_graphs
            while any(r.request_id == rid for r in (*sched.running, *sched.waiting)):
                engine.step()
            rows.append(MixedStep(f"decode + {p} prompt tokens", b, p, graphed, n, ms, host))
    for rid in ids:
        engine.abort(rid)
    return MixedResult(batch=b, context=bc.context, rows=rows)


def bench_prefill(engine: LLMEngine, bc: BenchConfig, splits: int, matmul: float) -> PrefillResult:
    device = torch.device(bc.device)
    length = bc.prefill_tokens // splits
    prompts = _prompts(splits, length, engine.model_config.vocab_size, bc.seed + 7919 * splits)
    _prefill_step(engine, prompts, f"warm{splits}", device)
    times = [_prefill_step(engine, prompts, f"p{splits}-{r}", device)
             for r in tqdm(range(bc.reps), desc=f"prefill {splits}x{length}", disable=not bc.progress)]
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    ids = [engine.add_request(p, params, request_id=f"f{splits}-{i}") for i, p in enumerate(prompts)]
    fwd = forward_only_ms(engine, bc.reps, device)
    for rid in ids:
        engine.abort(rid)
    return PrefillResult(prompts=splits, tokens=bc.prefill_tokens, reps=bc.reps,
                         step_ms_median=statistics.median(times), step_ms_min=min(times), forward_ms=fwd,
                         matmul_tflops=matmul, flops=prefill_flops(engine.model_config, [length] * splits))


# ---- FP8 against the model dtype, in one run -------------------------------------------------------------------

KV_FP8 = "kv-fp8"  # a variant part: the KV pool in float8_e4m3fn (`--kv-cache-dtype fp8`)
LEAK_LIMIT = 2**30  # CUDA memory a freed engine may leave allocated (workspaces), far below any model's weights


@dataclass(frozen=True)
class Fp8Variant:
    quantize: str | None  # make-model's --quantize choice (None: the preset's dtype)
    kv_cache_dtype: str = "auto"

    @property
    def name(self) -> str:
        parts = [self.quantize] if self.quantize else []
        return "+".join(parts + ([KV_FP8] if self.kv_cache_dtype == "fp8" else [])) or "base"


BASE = Fp8Variant(None)


def parse_fp8_variants(text: str) -> tuple[Fp8Variant, ...]:
    """`--compare-fp8`'s variants: comma-separated, each a weight format and / or kv-fp8 joined by '+'."""
    out = []
    for item in text.split(","):
        parts = item.split("+")
        weights = [p for p in parts if p in QUANTIZE_CHOICES]
        if (not item or len(weights) > 1 or len(set(parts)) != len(parts)
                or any(p not in (*QUANTIZE_CHOICES, KV_FP8) for p in parts)):
            raise ValueError(f"--compare-fp8: expected variants of one of {', '.join(QUANTIZE_CHOICES)} and / or "
                             f"{KV_FP8} joined by '+' (e.g. fp8-block+{KV_FP8}), got {item!r}")
        out.append(Fp8Variant(weights[0] if weights else None, "fp8" if KV_FP8 in parts else "auto"))
    names = [v.name for v in out]
    if len(set(names)) != len(names):
        raise ValueError(f"--compare-fp8: expected distinct variants, got {text!r}")
    return tuple(out)


@dataclass(frozen=True)
class VariantResult:
    name: str
    quantize: str | None
    kv_cache_dtype: str
    kv_dtype: str                 # the KV pool's torch dtype
    fp8_linears: int              # FP8Linear modules holding float8_e4m3fn weights
    linears: int                  # nn.Linear modules left in the model dtype
    weight_bytes: int             # the model's tensors, FP8 weights and their scales included
    fp8_weight_bytes: int
    allocated_bytes: int          # CUDA memory allocated once the engine was built, above the run's start
    left_bytes: int               # allocated after it was freed, above the run's start (0 on the CPU)
    decode: list[DecodeResult] = field(default_factory=list)
    prefill: list[PrefillResult] = field(default_factory=list)
    error: str | None = None      # why the variant has no rows (its engine failed to build or to run)


@dataclass(frozen=True)
class CompareReport:
    meta: dict
    copy_gbps: float
    matmul_tflops: float
    variants: list[VariantResult] = field(default_factory=list)


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def model_bytes(engine: LLMEngine) -> tuple[int, int, int, int]:
    """(FP8 Linears, other Linears, bytes of the model's tensors, of which in float8_e4m3fn) of the engine's model."""
    model = engine.model
    fp8 = sum(isinstance(m, FP8Linear) and m.weight.dtype == FP8_DTYPE for m in model.modules())
    dense = sum(type(m) is torch.nn.Linear for m in model.modules())
    state = model.state_dict().values()
    return (fp8, dense, sum(t.numel() * t.element_size() for t in state),
            sum(t.numel() * t.element_size() for t in state if t.dtype == FP8_DTYPE))


def _time_variant(engine: LLMEngine, bc: BenchConfig, copy: float, mm: float
                  ) -> tuple[list[DecodeResult], list[PrefillResult]]:
    # The roofline's bytes from the engine's real tensors: the formula counts the model dtype, not FP8 weights and KV.
    decode = [bench_decode(engine, bc, b, copy) for b in bc.batches]
    decode = [replace(d, traffic=d.traffic_from_tensors) for d in decode]
    return decode, [bench_prefill(engine, bc, s, mm) for s in bc.prefill_splits]


def bench_variant(bc: BenchConfig, variant: Fp8Variant, copy: float, mm: float, start: int) -> VariantResult:
    """One variant's engine built, timed and freed: it must be gone (no reference left, its CUDA memory returned to
    the run's start within LEAK_LIMIT) before the next one is built, since two do not fit beside each other."""
    device = torch.device(bc.device)
    vbc = replace(bc, quantize=variant.quantize, kv_cache_dtype=variant.kv_cache_dtype)
    engine, model_ref, stats, kv, allocated = None, None, (0, 0, 0, 0), "", 0
    decode: list[DecodeResult] = []
    prefill: list[PrefillResult] = []
    error = None
    try:
        engine = build_engine(vbc)
        model_ref = weakref.ref(engine.model)
        stats, kv, allocated = model_bytes(engine), str(engine.kv_dtype).split(".")[-1], _allocated(device) - start
        print(f"[{variant.name}] built: {stats[0]} FP8 Linears, {stats[1]} other Linears, weights "
              f"{_size(stats[2])} ({_size(stats[3])} FP8), KV {kv}; CUDA memory allocated {_size(allocated)} above "
              f"the run's start", flush=True)
        if variant.quantize is not None and not stats[0]:
            raise RuntimeError(f"{variant.name}: expected FP8 Linears in the model, found none")
        decode, prefill = _time_variant(engine, vbc, copy, mm)
    except Exception as e:  # one variant's failure (a kernel, memory) must not lose the others' rows
        error = f"{type(e).__name__}: {e}"
        print(f"[{variant.name}] failed: {error}", flush=True)
    engine = None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    left = _allocated(device) - start
    print(f"[{variant.name}] freed: CUDA memory allocated {_size(left)} above the run's start", flush=True)
    if model_ref is not None and model_ref() is not None:
        raise RuntimeError(f"{variant.name}: expected its model freed once timed, but something still references it")
    if left > LEAK_LIMIT:
        raise RuntimeError(f"{variant.name}: expected at most {LEAK_LIMIT / 2**30:.0f} GiB of CUDA memory left "
                           f"allocated once its engine was freed, got {left / 2**30:.2f} GiB")
    for d in decode:
        print(f"[{variant.name}] decode B={d.batch}: {d.step_ms:.3f} ms", flush=True)
    for p in prefill:
        print(f"[{variant.name}] prefill {p.prompts} x {p.tokens // p.prompts}: {p.step_ms_median:.2f} ms", flush=True)
    return VariantResult(name=variant.name, quantize=variant.quantize, kv_cache_dtype=variant.kv_cache_dtype,
                         kv_dtype=kv, fp8_linears=stats[0], linears=stats[1], weight_bytes=stats[2],
                         fp8_weight_bytes=stats[3], allocated_bytes=allocated, left_bytes=left, decode=decode,
                         prefill=prefill, error=error)


def run_compare(bc: BenchConfig, variants: Sequence[Fp8Variant], command: str,
                sink: Callable[[CompareReport], None] = lambda r: None) -> CompareReport:
    """The preset in its dtype, then each variant, one engine at a time; `sink` gets the report after each (a run
    cut short keeps the rows it has)."""
    device = torch.device(bc.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: expected a CUDA device, found none")
    torch.manual_seed(bc.seed)
    copy = copy_gbps(bc.copy_mib * 2**20, device)
    mm_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    mm = matmul_tflops(bc.matmul_n, mm_dtype, device)
    print(f"copy {copy:.0f} GB/s, {mm_dtype} matmul n={bc.matmul_n}: {mm:.2f} TFLOP/s", flush=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    start = _allocated(device)
    cfg = ModelConfig.from_hf_dict(build_config(bc.preset))
    meta = {"device_name": device_name(device), "commit": git_commit(), "torch": torch.__version__,
            "command": command, "preset": bc.preset, "dtype": cfg.torch_dtype,
            "ssm_dtype": bc.ssm_state_dtype or cfg.mamba_ssm_cache_dtype, "bench_config": asdict(bc),
            "start_allocated_bytes": start}
    report = CompareReport(meta=meta, copy_gbps=copy, matmul_tflops=mm)
    for v in (BASE, *variants):
        report.variants.append(bench_variant(bc, v, copy, mm, start))
        sink(report)
    return report


def compare_dict(r: CompareReport) -> dict:
    variants = []
    for v in r.variants:
        d = {k: getattr(v, k) for k in v.__dataclass_fields__ if k not in ("decode", "prefill")}
        variants.append({**d, "decode": [_with_props(x) for x in v.decode],
                         "prefill": [_with_props(x) for x in v.prefill]})
    return {"meta": r.meta, "copy_gbps": r.copy_gbps, "matmul_tflops": r.matmul_tflops, "variants": variants}


def compare_table(r: CompareReport) -> str:
    m, base = r.meta, r.variants[0]
    bc = m["bench_config"]
    lines = [f"## Engine: FP8 against {m['dtype']} — {m['device_name']}, commit {m['commit']}, torch {m['torch']}", "",
             f"`{m['command']}`", "",
             f"Preset `{m['preset']}` ({m['dtype']}, SSM state {m['ssm_dtype']}), decode at context {bc['context']} "
             f"(step ms: the steady state of async steps), prefill one step (median); each variant's engine built "
             f"after the previous one was freed.", ""]
    for v in r.variants:
        state = (f"failed: {v.error}" if v.error else
                 f"{v.fp8_linears} FP8 Linears beside {v.linears} others, weights {_size(v.weight_bytes)} "
                 f"({_size(v.fp8_weight_bytes)} FP8), KV {v.kv_dtype}; CUDA memory allocated above the run's start: "
                 f"{_size(v.allocated_bytes)} built, {_size(v.left_bytes)} once freed")
        lines.append(f"- `{v.name}`: {state}")
    others = r.variants[1:]
    lines += ["", f"| step | {m['dtype']} ms | " + " | ".join(f"{v.name} ms | ×" for v in others) + " |",
              "| --- | ---: |" + " ---: | ---: |" * len(others)]

    def cells(pick: Callable[[VariantResult], float | None]) -> str:
        b = pick(base)
        out = ["–" if b is None else f"{b:.3f}"]
        for v in others:
            x = pick(v)
            out += ["–" if x is None else f"{x:.3f}", "–" if x is None or b is None else f"{x / b:.3f}"]
        return " | ".join(out)

    for batch in bc["batches"]:
        lines.append(f"| decode, batch {batch} | " + cells(
            lambda v, b=batch: next((d.step_ms for d in v.decode if d.batch == b), None)) + " |")
    for splits in bc["prefill_splits"]:
        lines.append(f"| prefill {splits} × {bc['prefill_tokens'] // splits:,} | " + cells(
            lambda v, s=splits: next((p.step_ms_median for p in v.prefill if p.prompts == s), None)) + " |")
    return "\n".join(lines)


# ---- report ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Report:
    meta: dict
    copy_gbps: float
    matmul_tflops: float
    matmul_dtype: str
    cache: dict
    decode: list[DecodeResult] = field(default_factory=list)
    prefill: list[PrefillResult] = field(default_factory=list)
    prefill_continued: ContinuedPrefillResult | None = None
    mixed: MixedResult | None = None


def _with_props(obj: object) -> dict:
    """asdict plus the derived properties, for the JSON."""
    d = asdict(obj)
    for name in dir(type(obj)):
        if isinstance(getattr(type(obj), name), property):
            d[name] = getattr(obj, name)
    for key, value in d.items():
        sub = getattr(obj, key, None)
        if isinstance(value, dict) and hasattr(type(sub), "__dataclass_fields__"):
            d[key] = _with_props(sub)
    return d


def report_dict(r: Report) -> dict:
    return {"meta": r.meta, "copy_gbps": r.copy_gbps, "matmul_tflops": r.matmul_tflops,
            "matmul_dtype": r.matmul_dtype, "cache": r.cache,
            "decode": [_with_props(d) for d in r.decode], "prefill": [_with_props(p) for p in r.prefill],
            "prefill_continued": None if r.prefill_continued is None else _with_props(r.prefill_continued),
            "mixed": None if r.mixed is None else asdict(r.mixed)}


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f}"


def table(r: Report) -> str:
    m = r.meta
    lines = [f"## Engine: decode vs traffic roofline, prefill vs matmul rate — {m['device_name']}, "
             f"commit {m['commit']}, torch {m['torch']}", "",
             f"`{m['command']}`", "",
             f"Preset `{m['preset']}` ({m['params'] / 1e9:.2f} B params, {m['dtype']}, SSM state {m['ssm_dtype']}); "
             f"copy {r.copy_gbps:.0f} GB/s (read + write); {r.matmul_dtype} matmul {r.matmul_tflops:.1f} TFLOP/s "
             f"(n = {m['matmul_n']}); pools {r.cache['kv_bytes'] / 2**30:.2f} GiB KV ({r.cache['num_blocks']} "
             f"blocks) + {r.cache['state_bytes'] / 2**30:.2f} GiB state ({r.cache['num_slots']} slots)"
             + (f"; engine fused_gemv_max_tokens = {fg}." if (fg := m.get("fused_gemv_max_tokens",
                 m["bench_config"].get("fused_gemv_max_tokens"))) else "."), "",
             "| batch | mean context | step ms | wall / steps ms | one at a time ms | forward ms | roofline ms "
             "| step / roofline | goal | forward / roofline | tok/s | GB: weights / SSM / conv / KV |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for d in r.decode:
        t = d.traffic
        g = DECODE_GOALS.get(d.batch)
        goal = "–" if g is None else f"≤ {g}× {'met' if d.ratio <= g else 'missed'}"
        lines.append(f"| {d.batch} | {d.mean_context_tokens:.0f} | {d.step_ms:.3f} | {d.step_ms_mean:.3f} "
                     f"| {d.step_ms_one_at_a_time:.3f} "
                     f"| {d.forward_ms:.3f} "
                     f"| {d.roofline_ms:.3f} | {d.ratio:.2f}× | {goal} | {d.forward_ratio:.2f}× "
                     f"| {d.tokens_per_s:,.0f} | {_gb(t.weights - t.inactive_experts + t.embedding_rows)} / {_gb(t.ssm_state)} / "
                     f"{_gb(t.conv_state)} / {_gb(t.kv_read + t.kv_write)} |")
    lines += ["", "| prompts × tokens | step ms | tok/s | TFLOP | TFLOP/s | MFU (step) | MFU (forward) | goal |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for p in r.prefill:
        lines.append(f"| {p.prompts} × {p.tokens // p.prompts} | {p.step_ms_median:.1f} | {p.tokens_per_s:,.0f} "
                     f"| {p.flops.total / 1e12:.2f} | {p.tflops:.1f} | {p.mfu:.1%} | {p.forward_mfu:.1%} "
                     f"| ≥ {MFU_GOAL:.0%} {'met' if p.mfu >= MFU_GOAL else 'missed'} |")
    if (c := r.prefill_continued) is not None:
        fresh = next((p for p in r.prefill if p.prompts == 1), None)
        vs = f" ({c.tokens_per_s / fresh.tokens_per_s:.2f}× the 1 × {fresh.tokens} step's tok/s)" if fresh else ""
        lines += ["", f"Serving-like step: {c.tail} tokens continuing a prompt after its first {c.head} (prefix KV + "
                  f"state) beside a fresh prompt of {c.tail}: {c.step_ms_median:.1f} ms, {c.tokens_per_s:,.0f} "
                  f"tok/s{vs}."]
    if (mx := r.mixed) is not None:
        lines += ["", f"Mixed steps: {mx.batch} decode rows at context ~{mx.context}, alone and beside a prompt's chunk "
                  "(wall ms per step with async scheduling; host ms per `step()` call, median):", "",
                  "| step | graphed | ms per step | host ms per call | host / step |", "| --- | --- | ---: | ---: | ---: |"]
        for row in mx.rows:
            lines.append(f"| {row.label} | {'yes' if row.graphed else 'no'} | {row.step_ms:.2f} | {row.host_ms:.2f} "
                         f"| {row.host_ms / row.step_ms:.0%} |")
    return "\n".join(lines)


def plot_decode_roofline(results_json_path: str | Path, png_path: str | Path) -> Path:
    """PNG of decode step time (and model forward) against batch, the traffic roofline drawn, from the JSON."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(Path(results_json_path).read_text())
    rows = sorted(data["decode"], key=lambda d: d["batch"])
    if not rows:
        raise ValueError(f"{results_json_path}: expected decode results, got none")
    b = [d["batch"] for d in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    # (JSON written before async scheduling has only the median of synchronised steps.)
    ax.plot(b, [d.get("step_ms", d["step_ms_median"]) for d in rows], "o-", label="engine step")
    ax.plot(b, [d["forward_ms"] for d in rows], "s--", label="model forward + lm_head")
    ax.plot(b, [d["roofline_ms"] for d in rows], "k-", lw=2, label=f"roofline (copy {data['copy_gbps']:.0f} GB/s)")
    for batch, goal in DECODE_GOALS.items():
        hit = [d for d in rows if d["batch"] == batch]
        if hit:
            ax.plot([batch], [goal * hit[0]["roofline_ms"]], "kv", mfc="none", ms=9)
    ax.plot([], [], "kv", mfc="none", label="goal (1.2× at 1, 1.3× at 256)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(b, [str(x) for x in b])
    ax.set_xlabel("decode batch (requests)")
    ax.set_ylabel("ms per decode step")
    m = data["meta"]
    ax.set_title(f"{m['preset']} decode, context {rows[0]['context']} — {m['device_name']} ({m['commit']})",
                 fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    png = Path(png_path)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


# ---- main -----------------------------------------------------------------------------------------------------

def device_and_pick(args: argparse.Namespace, defaults: dict[str, dict]) -> tuple[str, Callable[[str], object]]:
    """The device (`--smoke`: the CPU; else `--device`, or CUDA where there is one) and a lookup of each flag's
    value: the one given, else `defaults`' for that device ("smoke" on the CPU, "cuda")."""
    if args.smoke and args.device == "cuda":
        raise ValueError("--smoke: expected --device cpu (or none), got cuda")
    device = "cpu" if args.smoke else (args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    d = defaults["smoke" if args.smoke or device == "cpu" else "cuda"]

    def pick(name: str):
        v = getattr(args, name)
        return d[name] if v is None else v

    return device, pick


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, BenchConfig | None]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"])
    ap.add_argument("--preset", help="make_model preset (default 8b-like; tiny with --smoke)")
    ap.add_argument("--batches", help="decode batch sizes, comma-separated (default 1,32,256)")
    ap.add_argument("--context", type=int, help="prompt tokens per decode request (default 1024)")
    ap.add_argument("--steps", type=int, help="timed decode steps per batch, after as many warm-up steps")
    ap.add_argument("--prefill-tokens", type=int, help="tokens of the prefill step (default 8192)")
    ap.add_argument("--prefill-splits", help="prompts sharing those tokens, comma-separated (default 1,4)")
    ap.add_argument("--reps", type=int, help="timed prefill steps per shape")
    ap.add_argument("--no-prefill-continued", action="store_true",
                    help="skip the serving-like prefill step (a prompt continuing after a prefix, beside a fresh one)")
    ap.add_argument("--mixed-batch", type=int,
                    help="decode rows of the mixed-step rows (default 64; 0 = skip them)")
    ap.add_argument("--mixed-prompt-tokens", help="prompt tokens beside them per step, comma-separated (default 128,512)")
    ap.add_argument("--mixed-graph-tokens", type=int,
                    help="the engine's mixed_graph_tokens: mixed steps of at most this many prompt tokens are also "
                         "timed as CUDA graphs (default 512; 0 = eager only)")
    ap.add_argument("--copy-mib", type=int, help="copy size for the bandwidth (default 1024)")
    ap.add_argument("--matmul-n", type=int, help="n of the n^3 matmul for the peak rate (default 8192)")
    ap.add_argument("--ssm-state-dtype", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--fused-gemv-max-tokens", type=int,
                    help="the engine's fused_gemv_max_tokens: decode steps of at most this many tokens run the "
                         "fused-prologue GEMVs (default: the engine's, 1 on an H100 or H200, else 0)")
    ap.add_argument("--compare-fp8", metavar="VARIANTS",
                    help="time the preset in its dtype, then each variant, one engine at a time (each freed before "
                         "the next is built), and print step times side by side with their ratios: decode at "
                         "--batches and prefill of --prefill-tokens (default one prompt; no continued or mixed steps). "
                         f"Comma-separated variants, each {' or '.join(QUANTIZE_CHOICES)} (FP8 weights as make-model "
                         f"--quantize writes them) and / or {KV_FP8} (--kv-cache-dtype fp8) joined by '+', e.g. "
                         f"fp8-block,fp8,fp8-block+{KV_FP8}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny preset on the CPU, small numbers (seconds)")
    ap.add_argument("--out", type=Path, help=f"directory for {JSON_NAME} (or a .json file path)")
    ap.add_argument("--plot", type=Path, metavar="RESULTS_JSON", help="only write the PNG from a results JSON")
    ap.add_argument("--png", type=Path, help="PNG path for --plot (default: next to the JSON)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.plot is not None:
        return args, None
    args.variants = None if args.compare_fp8 is None else parse_fp8_variants(args.compare_fp8)
    defaults = DEFAULTS
    if args.variants is not None:
        defaults = {k: {**d, **COMPARE_DEFAULTS} for k, d in DEFAULTS.items()}
        args.no_prefill_continued = True
    device, pick = device_and_pick(args, defaults)

    bc = BenchConfig(device=device, preset=pick("preset"), batches=_int_list("--batches", str(pick("batches"))),
                     context=pick("context"), steps=pick("steps"), prefill_tokens=pick("prefill_tokens"),
                     prefill_splits=_int_list("--prefill-splits", str(pick("prefill_splits"))), reps=pick("reps"),
                     copy_mib=pick("copy_mib"), matmul_n=pick("matmul_n"), ssm_state_dtype=args.ssm_state_dtype,
                     fused_gemv_max_tokens=args.fused_gemv_max_tokens, seed=args.seed,
                     prefill_continued=not args.no_prefill_continued, mixed_batch=pick("mixed_batch"),
                     mixed_graph_tokens=pick("mixed_graph_tokens"),
                     mixed_prompt_tokens=_int_list("--mixed-prompt-tokens", str(pick("mixed_prompt_tokens"))),
                     progress=not args.no_progress)
    return args, bc


def run(bc: BenchConfig, command: str) -> Report:
    device = torch.device(bc.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: expected a CUDA device, found none")
    torch.manual_seed(bc.seed)
    copy = copy_gbps(bc.copy_mib * 2**20, device)
    mm_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    mm = matmul_tflops(bc.matmul_n, mm_dtype, device)
    print(f"copy {copy:.0f} GB/s, {mm_dtype} matmul n={bc.matmul_n}: {mm:.2f} TFLOP/s", flush=True)
    engine = build_engine(bc)
    plan = engine.plan
    cache = {"num_blocks": plan.num_blocks, "block_bytes": plan.block_bytes, "num_slots": plan.num_slots,
             "slot_bytes": plan.slot_bytes, "kv_bytes": plan.num_blocks * plan.block_bytes,
             "state_bytes": plan.num_slots * plan.slot_bytes,
             "cache_memory_bytes": engine.config.cache_memory_bytes}
    n_params = sum(p.numel() for p in engine.model.parameters())
    print(f"engine: {bc.preset} {n_params / 1e9:.3f} B params; pools: KV {plan.num_blocks} blocks x "
          f"{plan.block_bytes} B = {cache['kv_bytes'] / 2**30:.2f} GiB, state {plan.num_slots} slots x "
          f"{plan.slot_bytes} B = {cache['state_bytes'] / 2**30:.2f} GiB", flush=True)
    meta = {"device_name": device_name(device), "commit": git_commit(), "torch": torch.__version__,
            "command": command, "preset": bc.preset, "params": n_params, "dtype": str(engine.dtype).split(".")[-1],
            "ssm_dtype": str(engine.ssm_dtype).split(".")[-1], "matmul_n": bc.matmul_n,
            "bench_config": asdict(bc), "fused_gemv_max_tokens": engine.fused_gemv_max_tokens}
    decode = [bench_decode(engine, bc, b, copy) for b in bc.batches]
    prefill = [bench_prefill(engine, bc, s, mm) for s in bc.prefill_splits]
    continued = bench_prefill_continued(engine, bc) if bc.prefill_continued else None
    mixed = bench_mixed(engine, bc) if bc.mixed_batch else None
    for d in decode:
        if d.traffic != d.traffic_from_tensors:
            raise RuntimeError(f"decode traffic B={d.batch}: formula {d.traffic} != tensors {d.traffic_from_tensors}")
    return Report(meta=meta, copy_gbps=copy, matmul_tflops=mm, matmul_dtype=str(mm_dtype).split(".")[-1],
                  cache=cache, decode=decode, prefill=prefill, prefill_continued=continued, mixed=mixed)


def _json_path(out: Path) -> Path:
    return out if out.suffix == ".json" else out / JSON_NAME


def main(argv: list[str] | None = None) -> int:
    args, bc = parse_args(argv)
    if bc is None:
        png = plot_decode_roofline(args.plot, args.png or args.plot.with_suffix(".png"))
        print(f"wrote {png}")
        return 0
    command = " ".join(["python benchmarks/engine_bench.py", *(sys.argv[1:] if argv is None else argv)])
    if args.variants is not None:
        def sink(r: CompareReport) -> None:
            if args.out is not None:
                path = _json_path(args.out)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(compare_dict(r), indent=2) + "\n")

        compared = run_compare(bc, args.variants, command, sink)
        if args.out is not None:
            print(f"wrote {_json_path(args.out)}")
        print()
        print(compare_table(compared))
        return 0
    report = run(bc, command)
    if args.out is not None:
        path = _json_path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report_dict(report), indent=2) + "\n")
        print(f"wrote {path}")
    print()
    print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
