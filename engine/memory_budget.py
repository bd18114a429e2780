"""The GPU memory an engine gives its KV + state pools, and how many requests those hold.

Where `EngineConfig.cache_memory_bytes` is None on CUDA, this engine may use `gpu_memory_utilization` of the
GPU's total memory in all (as vLLM's flag of that name): the pools get what is left of it after the weights,
the peak activations of the largest step and the CUDA graphs' memory, all three measured at start
(`LLMEngine`). What other processes held when the engine started (another node on the same GPU, for one) is
not ours to take: a fraction that does not fit beside them is refused, so that two nodes sharing a GPU split it
with a fraction each (e.g. 0.45 and 0.45). `max_num_seqs` left unset becomes what the pools hold.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 2**30
# The pools' size on a CPU device where no `--cache-memory-mb` gives one: there is no free-memory report to size
# from, and CPU engines serve tests and demos.
CPU_CACHE_MEMORY_BYTES = 256 * 2**20
# Running requests at most on a CPU device where no `--max-num-seqs` gives a number.
CPU_MAX_NUM_SEQS = 32
# The most running requests a GPU engine takes where no `--max-num-seqs` gives a number (vLLM's default): past
# it a decode step's rows stop gaining throughput and the CUDA graphs to capture multiply.
AUTO_MAX_NUM_SEQS = 256
# The share of the pools' budget the state pool may take when `max_num_seqs` is sized from it: the rest stays
# KV blocks, so that the requests admitted also have room for their context.
STATE_SHARE = 0.5


@dataclass(frozen=True)
class MemoryReport:
    """What the engine measured at start, in bytes."""
    total: int        # the GPU's memory
    free: int         # free when the engine started, before its weights (other processes hold the rest)
    weights: int      # the model's (and drafter's) weights
    activations: int  # the peak a step of the largest budget allocates beyond the weights and pools
    graphs: int       # the CUDA graphs' private memory (0 without graphs)

    def __post_init__(self) -> None:
        for name in ("total", "free", "weights", "activations", "graphs"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"memory report '{name}': expected bytes >= 0, got {v!r}")
        if self.free > self.total:
            raise ValueError(f"memory report 'free': expected at most total ({self.total}), got {self.free}")


def check_utilization(f: float) -> None:
    if isinstance(f, bool) or not isinstance(f, int | float) or not 0 < f <= 1:
        raise ValueError(f"engine field 'gpu_memory_utilization': expected a fraction in (0, 1], got {f!r}")


def cache_budget(report: MemoryReport, utilization: float) -> int:
    """Bytes for the KV + state pools: `utilization` x total, less weights, activations and graphs. Raises
    ValueError, saying what to change, where the fraction does not fit beside other processes or leaves nothing."""
    check_utilization(utilization)
    asked = int(utilization * report.total)
    others = report.total - report.free
    if asked > report.free:
        raise ValueError(
            f"engine field 'gpu_memory_utilization': {utilization} asks {asked / GiB:.1f} GiB of the GPU's "
            f"{report.total / GiB:.1f} GiB, but other processes hold {others / GiB:.1f} GiB and only "
            f"{report.free / GiB:.1f} GiB are free: expected at most {report.free / report.total:.2f} (nodes sharing "
            f"a GPU each take a share, e.g. --gpu-memory-utilization 0.45 for two), or free the GPU")
    used = report.weights + report.activations + report.graphs
    left = asked - used
    if left <= 0:
        raise ValueError(
            f"engine field 'gpu_memory_utilization': {utilization} x {report.total / GiB:.1f} GiB = "
            f"{asked / GiB:.2f} GiB leaves nothing for the KV and state pools after weights "
            f"{report.weights / GiB:.2f} GiB, activations {report.activations / GiB:.2f} GiB and CUDA graphs "
            f"{report.graphs / GiB:.2f} GiB: expected a larger fraction, a smaller --max-num-batched-tokens, "
            f"or a model that fits")
    return left


def max_rows_cap(max_num_batched_tokens: int, tokens_per_row: int) -> int:
    """The most running requests an unset `max_num_seqs` may become: AUTO_MAX_NUM_SEQS, and no more than fill half
    the step budget with their rows of `tokens_per_row` (1+K) tokens, so that a full batch still leaves room for
    prompt chunks (else a new prompt waits for a request to finish)."""
    return max(1, min(AUTO_MAX_NUM_SEQS, max_num_batched_tokens // (2 * tokens_per_row)))


def auto_max_num_seqs(cache_bytes: int, slot_bytes: int, block_bytes: int, max_num_batched_tokens: int,
                      tokens_per_row: int) -> int:
    """Running requests for pools of `cache_bytes`: as many state slots (`slot_bytes` each) as STATE_SHARE of it
    holds, at most `max_rows_cap`, one scratch slot and the scratch block kept aside. Raises ValueError where not
    even one request fits."""
    cap = max_rows_cap(max_num_batched_tokens, tokens_per_row)
    fit = cap if slot_bytes == 0 else int(cache_bytes * STATE_SHARE) // slot_bytes - 1
    n = min(cap, fit)
    if n < 1 or cache_bytes < (n + 1) * slot_bytes + 2 * block_bytes:
        raise ValueError(
            f"engine field 'cache_memory_bytes': expected room for one request's state ({slot_bytes} B a slot, "
            f"{STATE_SHARE:.0%} of the pools at most) and one KV block ({block_bytes} B), with their scratch ones, "
            f"got {cache_bytes} B: lower --max-num-batched-tokens or raise --gpu-memory-utilization")
    return n


def summary(device_name: str, report: MemoryReport | None, kv_bytes: int, num_blocks: int, block_size: int,
            state_bytes: int, num_slots: int, max_model_len: int) -> str:
    """The one startup line: where the memory went, and the concurrency and context it buys."""
    def g(b: int) -> str:
        return f"{b / GiB:.2f} GiB" if b >= GiB else f"{b / 2**20:.1f} MiB"

    parts = [f"engine on {device_name}:"]
    if report is not None:
        parts.append(f"weights {g(report.weights)}, activations {g(report.activations)}, "
                     f"CUDA graphs {g(report.graphs)},")
    parts.append(f"KV {g(kv_bytes)} ({num_blocks} blocks, {num_blocks * block_size} tokens), "
                 f"state {g(state_bytes)} ({num_slots} slots): up to {num_slots} running requests, "
                 f"context up to {min(max_model_len, num_blocks * block_size)} tokens a request")
    if report is not None:
        parts.append(f"({report.total / GiB:.1f} GiB GPU, {(report.total - report.free) / GiB:.1f} GiB held by "
                     f"other processes at start)")
    return " ".join(parts)
