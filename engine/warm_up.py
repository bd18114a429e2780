"""The prompts an engine runs once before serving, so that its prefill path's kernels are compiled before the first
request instead of inside it.

Triton compiles a kernel per specialization on first launch (a constexpr flag such as "this sequence starts from a
carried state", an integer argument divisible by 16 or not), which on a large model takes a second or more each. A
first prompt only meets the fresh-prompt variants; the continued chunk of a long prompt, and a prompt that
starts from a prefix-cache hit, meet others later, a step of many rows others again, and a step whose rows are
short (a cached conversation's next turn: the tile sizes follow the longest row) others still, inside a request's
time to first token. Each wave below runs to completion before the next is added, so that a wave finds the earlier ones'
prefixes in the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

# Token ids of the warm-up prompts: fixed, so that every start compiles the same variants.
FIRST_ID = 3
# Rows of the many-rows wave's step.
MANY_ROWS = 16
# Own tokens of the short-tail waves: 2^k computed by a prefill node (N-1) and by an aggregated one (N).
SHORT_TAILS = (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65)


def warm_up_waves(budget: int, max_len: int, stride_tokens: int | None) -> list[list[tuple[int, int]]]:
    """Prompts per wave, each as (shared, own): `shared` leading ids every prompt has in common, then `own` ids of
    its own. `budget`: the step's token budget (a prompt longer than it continues in a second chunk); `max_len`: the
    longest prompt the engine takes; `stride_tokens`: the prefix cache's checkpoint stride in tokens (None: no
    prefix cache)."""
    if budget < 1 or max_len < 2:
        raise ValueError(f"warm-up: expected a step budget >= 1 and a max prompt length >= 2, got {budget} and "
                         f"{max_len}")
    fits = max_len - 64  # room for the longest wave's own ids
    long = min(fits, budget + 37)
    if stride_tokens is not None:
        long = max(long, min(fits, stride_tokens + 37))
    waves: list[list[tuple[int, int]]] = [[(33, 0), (48, 0)]]
    if long > 1:
        # A second chunk; then the same prompt and more, from a prefix-cache hit where there is a cache.
        waves += [[(long, 0)], [(long + 50, 0)]]
    # Many rows in one step (a count divisible by 16, which Triton compiles apart): where there is a cache, each
    # from the long prompt's hit, as a busy prefill node's steps are.
    shared = long if stride_tokens is not None and long > 1 else 16
    waves.append([(shared, 1 + i) for i in range(MANY_ROWS)])
    # Steps of one short row each, its longest row 1, 2, 4 ... 64 tokens computed (a prefill node computes one
    # fewer than an aggregated one, so both counts): the tile sizes, and the counts equal to 1, that a turn
    # continued from a cached prefix with a short message meets. From the prefix cache's hit where there is one.
    hit = stride_tokens * ((long - 1) // stride_tokens) if stride_tokens is not None and long > stride_tokens else 0
    for own in SHORT_TAILS:
        if own <= budget and hit + own >= 2:
            waves.append([(hit, own)])
    return [[_within(s, o, max_len - 1) for s, o in w] for w in waves]


def _within(shared: int, own: int, most: int) -> tuple[int, int]:
    """(shared, own) cut to at most `most` ids in all (a short max_model_len), the own ones last to go."""
    own = min(own, most - 1)
    return min(shared, most - own), own


def warm_up_prompt(shared: int, own: int, vocab_size: int, salt: int) -> list[int]:
    """`shared` ids every warm-up prompt starts with, then `own` ids of prompt `salt`'s."""
    span = max(1, vocab_size - FIRST_ID)
    return ([FIRST_ID + (7 * i) % span for i in range(shared)]
            + [FIRST_ID + (11 * salt + 5 * i + 1) % span for i in range(own)])


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
