"""The prompts an engine runs once before serving, so that its prefill path's kernels are compiled before the first
request instead of inside it.

Triton compiles a kernel per specialization on first launch (a constexpr flag such as "this sequence starts from a
carried state", an integer argument divisible by 16 or not), which on a large model takes a second or more each. A
first prompt only meets the fresh-prompt variants; the continued chunk of a long prompt, and a prompt that
starts from a prefix-cache hit, meet others later, inside a request's time to first token. Each wave below runs to
completion before the next is added, so that the second wave finds the first one's prefix in the cache.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("baton.engine.warm_up")

# Token ids of the warm-up prompts: fixed, so that every start compiles the same variants.
FIRST_ID = 3


def warm_up_waves(budget: int, max_len: int, stride_tokens: int | None) -> list[list[int]]:
    """Prompt lengths per wave. `budget`: the step's token budget (a prompt longer than it continues in a second
    chunk); `max_len`: the longest prompt the engine takes; `stride_tokens`: the prefix cache's checkpoint stride
    in tokens (None: no prefix cache)."""
    if budget < 1 or max_len < 2:
        raise ValueError(f"warm-up: expected a step budget >= 1 and a max prompt length >= 2, got {budget} and "
                         f"{max_len}")
    long = min(max_len - 64, budget + 37)
    if stride_tokens is not None:
        long = max(long, min(max_len - 64, stride_tokens + 37))
    waves = [[33, 48], [long] if long > 1 else []]
    if long > 1:
        # The same prompt and more: from a prefix-cache hit where there is a cache, else a second long prompt.
        waves.append([long + 50])
    return [w for w in waves if w]


def warm_up_prompt(length: int, vocab_size: int) -> list[int]:
    """`length` token ids; every wave's prompts share their leading ids."""
    span = max(1, vocab_size - FIRST_ID)
    return [FIRST_ID + (7 * i) % span for i in range(length)]


@dataclass(frozen=True)
class WarmUp:
    """What a warm-up ran: its prompts, steps, prompt tokens computed and taken from the prefix cache, seconds."""
    prompts: int = 0
    steps: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    seconds: float = 0.0

    def summary(self) -> str:
        if not self.prompts:
            return "warm-up: none (nothing to compile here)"
        return (f"warm-up: {self.prompts} prompts in {self.steps} steps ({self.prompt_tokens} tokens computed, "
                f"{self.hit_tokens} from the prefix cache), {self.seconds:.1f} s")


def log_later_compiles() -> bool:
    """From now on, log every Triton kernel specialization this process meets for the first time: after a warm-up
    each one is a compile (or a disk-cache load) inside some request's step, and the log names the kernel and the
    argument specialization that a wider warm-up would cover. False where this Triton has no such hook."""
    try:
        import triton
    except ImportError:
        return False
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_cache_hook"):
        return False

    def hook(*, repr: str, **_) -> bool:  # noqa: A002 (Triton's keyword)
        log.warning("kernel specialization first met after the warm-up (compiled inside a step): %s", repr[:400])
        return False  # a true value would skip the compile

    runtime.jit_cache_hook = hook
    return True
