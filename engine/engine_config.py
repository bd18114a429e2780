"""Engine (serving) configuration: batch shape, cache sizes and numerics. Frozen and validated."""

from __future__ import annotations

from dataclasses import dataclass

from baton.engine.memory_budget import check_utilization

SUPPORTED_DTYPES = ("auto", "float32", "bfloat16", "float16")
# The attention KV pool's storage: "auto" the model dtype, "fp8" float8_e4m3fn with one scale per layer for K and V
# (`kv_cache_dtype.py`).
KV_CACHE_DTYPES = ("auto", "fp8")
# Which implementation the ops run (`ops.kernels.resolve_kernels`); here, not there, so that flags need no torch.
KERNEL_MODES = ("auto", "torch", "triton")
MAX_SPECULATIVE_TOKENS = 8
# A prefill node's step budget when none is given: its steps carry no decode rows, so a larger step costs no one's
# inter-token latency, and prefill throughput levels off only at a few thousand tokens a step
# (benchmarks/RESULTS.md, "Prefill").
PREFILL_MAX_NUM_BATCHED_TOKENS = 8192
# The default bound on a request's logprobs / prompt_logprobs alternatives (OpenAI's top_logprobs bound).
DEFAULT_MAX_LOGPROBS = 20


def _check_pos_int(name: str, v: object, allow_none: bool = False) -> None:
    if v is None and allow_none:
        return
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ValueError(f"engine field '{name}': expected a positive integer, got {v!r}")


@dataclass(frozen=True)
class EngineConfig:
    # Tokens per KV block.
    block_size: int = 16
    # Running requests at most; also the number of Mamba state slots. None: on CUDA what the pools hold
    # (`memory_budget.auto_max_num_seqs`), on a CPU `memory_budget.CPU_MAX_NUM_SEQS`.
    max_num_seqs: int | None = None
    # Token budget of one forward pass (decode rows + prefill chunks).
    max_num_batched_tokens: int = 512
    # Cap on one prefill chunk, so a long prompt cannot take the whole step (None = budget only).
    long_prefill_token_threshold: int | None = None
    # Bytes for the KV block pool plus the state pool; the block count is derived from it. None: on CUDA what
    # `gpu_memory_utilization` leaves after weights, activations and CUDA graphs (`memory_budget`), on a CPU
    # `memory_budget.CPU_CACHE_MEMORY_BYTES` ...
    cache_memory_bytes: int | None = None
    # ... unless given outright (tests use small pools to force preemption).
    num_kv_blocks: int | None = None
    # Longest sequence (prompt + output); None = the model's max_position_embeddings.
    max_model_len: int | None = None
    # Activation / weight dtype; "auto" = the checkpoint's torch_dtype.
    dtype: str = "auto"
    # SSM state pool dtype; None = the checkpoint's mamba_ssm_cache_dtype.
    ssm_state_dtype: str | None = None
    # The attention KV pool's storage: "auto" the model dtype; "fp8" float8_e4m3fn (half the bytes of a 16-bit
    # block, so twice the blocks for the same budget), quantized with a per-layer K scale and V scale: the
    # checkpoint's `k_scale` / `v_scale` where it ships them, else 1.0 (`kv_cache_dtype.py`).
    kv_cache_dtype: str = "auto"
    # "auto": CUDA where a GPU is visible, else the CPU.
    device: str = "auto"
    # Which implementation the ops run (`ops.kernels.resolve_kernels`), decided once at start: "auto" the Triton
    # kernels on CUDA and the torch references elsewhere, "torch" the references (to rule a kernel out when
    # debugging), "triton" the kernels (on a CPU in Triton's interpreter, as the tests run them).
    kernels: str = "auto"
    # The share of the GPU's total memory this engine may use in all (weights, activations, graphs, pools) where
    # `cache_memory_bytes` is None; nodes sharing a GPU each take a share.
    gpu_memory_utilization: float = 0.9
    # MTP speculative decoding: K draft tokens per decode step (0 = off). Needs a checkpoint with `mtp.*`
    # weights. Each running request's state slot then also records the inputs of its last 1+K verified
    # positions (replayed into the state once the accepted count is known, R3/R4), and it reserves K blocks
    # of lookahead room.
    num_speculative_tokens: int = 0
    # A prefill node's engine: it never samples or verifies, so it records no verify inputs even with K > 0;
    # the MTP module still runs over the prompt so that its KV travels with the target's (R8).
    prefill_only: bool = False
    # Replay pure decode steps (K = 0) as CUDA graphs, one per padded batch size, on CUDA devices; False runs
    # every step eagerly (for debugging, or a model whose layers cannot be captured).
    cuda_graphs: bool = True
    # Schedule and launch step n+1 while step n runs on the device, reading step n's tokens afterwards (its
    # CPU work then overlaps the GPU's). With K > 0 a verify step's committed length is known only from its tokens:
    # a whole-graph greedy verify step is chained on the one in flight (its inputs built on the device from that
    # one's results) where the next step can only be the same requests verifying their drafts; other steps run
    # one at a time.
    async_scheduling: bool = True
    # Steps of at most this many tokens (decode batches) run the linear layers and the lm_head as Triton GEMVs
    # with the op before each fused in (the residual add and RMSNorm, relu2: `ops.linear.reference`), instead of
    # cuBLAS plus a launch per op; 0 = off. Only where the Triton kernels run (CUDA). From 2 rows up the GEMV runs
    # on the tensor cores with the op before it as its own kernel (`ops.linear.kernel.default_tiles`). None (the
    # default): per GPU where that was measured faster (`ops.linear.tuning.FUSED_GEMV_GPUS`),
    # 0 elsewhere; `llm_engine.resolved_fused_gemv_max_tokens`.
    fused_gemv_max_tokens: int | None = None
    # Q > 0: a step with decode rows carries at most one prompt chunk of at most Q tokens, and such a step replays
    # a CUDA graph (`mixed_graphs.py`; the chunk padded to the smallest of Q, Q/4, ... down to 32 tokens that
    # holds it, `mixed_graph_buckets.py`) instead of running eagerly, where it is bound by the host. For decode
    # nodes that take prompts (the router's prefill overflow, short prompts) and aggregated servers under a TPOT
    # bound. Steps without decode rows are not limited. 0: off. K = 0 only. Where no graphs run (a CPU,
    # `cuda_graphs` off, MoE layers, the torch kernels) only the one-chunk scheduling applies. None (the default):
    # `llm_engine.AUTO_MIXED_GRAPH_TOKENS` (at most max_num_batched_tokens) where decode steps replay CUDA graphs
    # and K = 0, else 0 (`llm_engine.resolved_mixed_graph_tokens`).
    mixed_graph_tokens: int | None = None
    # Tensor-parallel ranks of this engine (one process each, `parallel.group`): every rank builds an engine with
    # the same config and its own rank's group, each holding its shard of the weights and of the caches.
    tensor_parallel_size: int = 1
    # Prefix caching (`prefix_cache.py`): full KV blocks and recurrent-state checkpoints of earlier prompts are kept
    # while their memory is not needed, and a request whose prompt starts like an earlier one prefills only the rest.
    enable_prefix_caching: bool = True
    # Blocks between checkpoint boundaries: a prefill chunk that reaches one ends there and its state is copied into
    # a checkpoint slot. Smaller reuses more of a shared prefix, larger cuts fewer chunks and takes fewer checkpoints.
    prefix_checkpoint_stride: int = 16
    # Checkpoint slots (each the size of a state slot without verify inputs), taken from the cache budget; None: one
    # per state slot (`max_num_seqs`).
    prefix_checkpoint_slots: int | None = None
    # The most top alternatives a request's `logprobs` / `prompt_logprobs` may ask for (more are refused): each costs
    # a top-k over the vocabulary per position and a longer read back.
    max_logprobs: int = DEFAULT_MAX_LOGPROBS

    def __post_init__(self) -> None:
        _check_pos_int("block_size", self.block_size)
        _check_pos_int("max_num_seqs", self.max_num_seqs, allow_none=True)
        _check_pos_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _check_pos_int("long_prefill_token_threshold", self.long_prefill_token_threshold, allow_none=True)
        _check_pos_int("cache_memory_bytes", self.cache_memory_bytes, allow_none=True)
        check_utilization(self.gpu_memory_utilization)
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(f"engine field 'device': expected 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        check_kernel_mode(self.kernels)
        _check_pos_int("num_kv_blocks", self.num_kv_blocks, allow_none=True)
        _check_pos_int("max_model_len", self.max_model_len, allow_none=True)
        _check_pos_int("tensor_parallel_size", self.tensor_parallel_size)
        _check_pos_int("prefix_checkpoint_stride", self.prefix_checkpoint_stride)
        _check_pos_int("prefix_checkpoint_slots", self.prefix_checkpoint_slots, allow_none=True)
        m = self.max_logprobs
        if not isinstance(m, int) or isinstance(m, bool) or m < 0:
            raise ValueError(f"engine field 'max_logprobs': expected an integer >= 0, got {m!r}")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"engine field 'dtype': expected one of {', '.join(SUPPORTED_DTYPES)}, got {self.dtype!r}")
        if self.ssm_state_dtype is not None and self.ssm_state_dtype not in SUPPORTED_DTYPES[1:]:
            raise ValueError(f"engine field 'ssm_state_dtype': expected one of {', '.join(SUPPORTED_DTYPES[1:])}, "
                             f"got {self.ssm_state_dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"engine field 'kv_cache_dtype': expected one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        for name in ("cuda_graphs", "async_scheduling", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"engine field '{name}': expected True or False, got {getattr(self, name)!r}")
        g = self.fused_gemv_max_tokens
        if g is not None and (not isinstance(g, int) or isinstance(g, bool) or g < 0):
            raise ValueError(f"engine field 'fused_gemv_max_tokens': expected an integer >= 0 or None, got {g!r}")
        q = self.mixed_graph_tokens
        if q is not None and (not isinstance(q, int) or isinstance(q, bool) or q < 0):
            raise ValueError(f"engine field 'mixed_graph_tokens': expected an integer >= 0 or None, got {q!r}")
        k = self.num_speculative_tokens
        if q and k:
            raise ValueError(f"engine field 'mixed_graph_tokens': expected 0 with speculative decoding "
                             f"(num_speculative_tokens = {k}), got {q}")
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"engine field 'num_speculative_tokens': expected an integer in "
                             f"0..{MAX_SPECULATIVE_TOKENS}, got {k!r}")
        if self.max_num_seqs is not None and self.max_num_batched_tokens < self.max_num_seqs * (1 + k):
            # Every running request must be able to decode (verify 1+K tokens) in the same step.
            raise ValueError(f"engine field 'max_num_batched_tokens': expected >= max_num_seqs * (1 + "
                             f"num_speculative_tokens) = {self.max_num_seqs * (1 + k)}, got "
                             f"{self.max_num_batched_tokens}")

    @property
    def verify_len(self) -> int:
        """Positions of verify inputs recorded per state slot: 1+K while verifying drafts, else 0."""
        return 0 if self.prefill_only or not self.num_speculative_tokens else 1 + self.num_speculative_tokens

    @property
    def prefill_chunk_cap(self) -> int:
        return self.long_prefill_token_threshold or self.max_num_batched_tokens


def check_kernel_mode(mode: object) -> None:
    if mode not in KERNEL_MODES:
        raise ValueError(f"engine field 'kernels': expected one of {', '.join(KERNEL_MODES)}, got {mode!r}")
