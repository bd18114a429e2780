"""Stop strings on the detokenized output (OpenAI's `stop`, the gRPC request's `stop`): the text that could still
start a stop string is held back; at a match the text is cut before it, and the match itself is never sent."""

from __future__ import annotations

# A stop string is searched for in the pending text after every token: their number and length are capped.
MAX_STOPS = 64
MAX_STOP_CHARS = 1024


def check_stops(stops: tuple[str, ...] | list[str], has_tokenizer: bool) -> None:
    """ValueError naming `stop` unless there are at most MAX_STOPS non-empty strings of at most MAX_STOP_CHARS
    characters, and a tokenizer to match them with."""
    if len(stops) > MAX_STOPS or not all(0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise ValueError(f"stop: expected at most {MAX_STOPS} non-empty strings of at most {MAX_STOP_CHARS} "
                         f"characters, got {len(stops)} of lengths {sorted({len(s) for s in stops})[:5]}")
    if stops and not has_tokenizer:
        raise ValueError("stop: stop strings need the router's tokenizer (start it with --tokenizer); send "
                         "sampling.stop_token_ids instead")


class StopMatcher:
    """Holds back the text that could still start a stop string; cuts the text before the first match."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.pending = ""

    def push(self, delta: str, final: bool) -> tuple[str, bool]:
        """(text to emit, whether a stop string matched)."""
        self.pending += delta
        hits = [i for s in self.stops if (i := self.pending.find(s)) >= 0]
        if hits:
            out, self.pending = self.pending[:min(hits)], ""
            return out, True
        keep = 0 if final else min(self.hold, len(self.pending))
        out, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        return out, False
