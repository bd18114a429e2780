"""A launched step's sampled tokens: on the device at once, on the host when `result()` returns.

Launching a step queues its work on the stream and returns; the tokens travel back with a non-blocking copy
into pinned memory and an event recorded after it. `result()` waits on that event only, so the host can
launch the next step first (async scheduling) and still read this step's tokens without waiting for the
next one: a plain `.tolist()` would wait for everything queued on the stream.

On CUDA a step also carries an event recorded just before its first GPU work (`device_mark`): once read,
`device_seconds()` is the GPU's time from there to the step's end. Under async scheduling that event fires when the
GPU finishes the step before, so it times this step alone; GPU time over wall time is how busy the GPU was, beside
how busy the engine loop was (`baton_node_step_device_seconds`). It is a span: gaps inside an eager step, where the
GPU waits for the host's next launch, count as GPU time.
"""

from __future__ import annotations

import torch

from baton.engine.host_copy import to_device
from baton.engine.logprobs import LogprobRows, TokenLogprob


def device_mark(device: torch.device | str) -> torch.cuda.Event | None:
    """An event recorded now on the current stream, timing enabled (None off CUDA): a step's start, recorded once
    the host has built its inputs, just before its first GPU work (else a GPU left waiting on the host would count
    as busy)."""
    if torch.device(device).type != "cuda":
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class PendingStep:
    def __init__(self, request_ids: list[str], tokens: torch.Tensor | None, device: torch.device,
                 logits: torch.Tensor | None = None, started: torch.cuda.Event | None = None,
                 logprobs: LogprobRows | None = None, prompt_logprobs: LogprobRows | None = None) -> None:
        """request_ids: the rows that sampled, in order; tokens [R] int64 on the device (None: no row sampled);
        logits [R, V] when the caller asked for them. Construct it after the step's last kernel is queued: on
        CUDA its event marks the step's end, tokens or not, and `result()` waits for it. A step that samples
        nothing (prefill chunks) is still waited for: its outputs hand caches over (a prefill node's finished
        prompt is read by another process), which must not happen before they are written. `started`: the
        step's `device_mark`, for `device_seconds()`. `logprobs` / `prompt_logprobs`: the step's logprob rows of
        sampled and of prompt tokens, copied back with the tokens (`read_logprobs`)."""
        self.request_ids = request_ids
        self.tokens = tokens
        self.logits = logits
        self._event: torch.cuda.Event | None = None
        self._host = tokens
        self._logprobs = (logprobs, prompt_logprobs)
        if device.type == "cuda":
            for rows in self._logprobs:
                if rows is not None:
                    rows.to_host()
            if tokens is not None:
                self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
                self._host.copy_(tokens, non_blocking=True)
            self._event = torch.cuda.Event(enable_timing=started is not None)
            self._event.record()
        self._started = started
        self._row_of: dict[str, int] | None = None

    def row_of(self, request_id: str) -> int | None:
        """Index of request_id's token in `tokens`, or None when it did not sample in this step."""
        if self._row_of is None:
            self._row_of = {r: i for i, r in enumerate(self.request_ids)}
        return self._row_of.get(request_id)

    def result(self) -> tuple[dict[str, int], dict[str, torch.Tensor] | None]:
        """Wait for this step's tokens (not for steps launched after it): request id -> token, and request id
        -> logits [V] when asked for."""
        if self._event is not None:
            self._event.synchronize()
        if self.tokens is None:
            return {}, None
        sampled = dict(zip(self.request_ids, self._host.tolist(), strict=True))
        logits = None if self.logits is None else {r: self.logits[i] for i, r in enumerate(self.request_ids)}
        return sampled, logits

    def read_logprobs(self) -> tuple[dict[str, tuple[int, list[TokenLogprob]]],
                                     dict[str, tuple[int, list[TokenLogprob]]]]:
        """Wait for this step and return its logprobs of sampled tokens and of prompt tokens (`LogprobRows.read`;
        empty where it has none)."""
        if self._event is not None:
            self._event.synchronize()
        out, prompt = self._logprobs
        return ({} if out is None else out.read()), ({} if prompt is None else prompt.read())

    def values(self) -> list[int]:
        """Wait for this step (not for steps launched after it) and return its whole token tensor, flattened (a
        verify step's packed results)."""
        if self._event is not None:
            self._event.synchronize()
        return [] if self.tokens is None else self._host.reshape(-1).tolist()

    def device_seconds(self) -> float:
        """The step's GPU time, from its start mark to its end (0.0 off CUDA, or without a mark); call it after
        `result()`: it does not wait."""
        if self._event is None or not self._event.query():
            return 0.0
        return elapsed_seconds(self._started, self._event)


def elapsed_seconds(started: torch.cuda.Event | None, ended: torch.cuda.Event | None) -> float:
    """GPU seconds between two marks that have both completed (0.0 if either is None)."""
    return 0.0 if started is None or ended is None else started.elapsed_time(ended) / 1e3


def fill_pending(input_ids: torch.Tensor, dst: list[int], src: list[int], tokens: torch.Tensor) -> None:
    """input_ids[dst] = tokens[src] on the device (the PENDING inputs of a step launched before its predecessor's
    tokens are read). In steady decoding both are 0..m-1: one copy, no index upload."""
    m = len(dst)
    if dst[-1] == m - 1 and src[-1] == m - 1 and dst == src == list(range(m)):
        input_ids[:m] = tokens[:m]
        return
    idx = to_device([dst, src], torch.int64, input_ids.device)
    input_ids[idx[0]] = tokens[idx[1]]
