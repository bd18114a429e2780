"""A launched step's sampled tokens: on the device at once, on the host when `result()` returns.

Launching a step queues its work on the stream and returns; the tokens travel back with a non-blocking copy
into pinned memory and an event recorded after it. `result()` waits on that event only, so the host can
launch the next step first (async scheduling) and still read this step's tokens without waiting for the
next one: a plain `.tolist()` would wait for everything queued on the stream.
"""

from __future__ import annotations

import torch

from baton.engine.host_copy import to_device


class PendingStep:
    def __init__(self, request_ids: list[str], tokens: torch.Tensor | None, device: torch.device,
                 logits: torch.Tensor | None = None) -> None:
        """request_ids: the rows that sampled, in order; tokens [R] int64 on the device (None: no row sampled);
        logits [R, V] when the caller asked for them. Construct it after the step's last kernel is queued: on
        CUDA its event marks the step's end, tokens or not, and `result()` waits for it. A step that samples
        nothing (prefill chunks) is still waited for: its outputs hand caches over (a prefill node's finished
        prompt is read by another process), which must not happen before they are written."""
        self.request_ids = request_ids
        self.tokens = tokens
        self.logits = logits
        self._event: torch.cuda.Event | None = None
        self._host = tokens
        if device.type == "cuda":
            if tokens is not None:
                self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
                self._host.copy_(tokens, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
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


def fill_pending(input_ids: torch.Tensor, dst: list[int], src: list[int], tokens: torch.Tensor) -> None:
    """input_ids[dst] = tokens[src] on the device (the PENDING inputs of a step launched before its predecessor's
    tokens are read). In steady decoding both are 0..m-1: one copy, no index upload."""
    m = len(dst)
    if dst[-1] == m - 1 and src[-1] == m - 1 and dst == src == list(range(m)):
        input_ids[:m] = tokens[:m]
        return
    idx = to_device([dst, src], torch.int64, input_ids.device)
    input_ids[idx[0]] = tokens[idx[1]]
