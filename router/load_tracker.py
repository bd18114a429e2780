"""One worker's load as the router sees it: the last polled numbers plus what it sent since.

Polls are periodic, so on their own every request arriving between two polls would see the same numbers
and go to the same worker. The tracker adds the work this router has sent that the last poll could not
have counted yet: a request is counted iff it was sent after that poll *began* (an epoch check), and
until it is answered. Work sent before the poll began is already in the worker's own numbers, with one exception
on decode workers: a request the worker has not acknowledged yet (its first token) may still be on its way into
the engine, or waiting there without a state slot, when the poll is answered. So a decode request counts until its
first token and from then on until a poll that began after that token answers.

A prefill worker's numbers also go stale the other way: a prompt the last poll counted as outstanding and whose
Prefill call has since returned is done, yet would stay in the estimate until the next poll — a GPU prefills tens
of thousands of tokens between two polls, enough to trip the router's `prefill_queue_limit_tokens` overflow while
the worker idles. So the prefill tokens of such returned requests are
taken off the last poll's number (never below 0) until the next poll answers. That is exact because a prefill node
counts a prompt until it hands its handle back (`LLMEngine.prefill_tokens_not_handed_back`), launched or not: the
estimate is then what the worker holds, queued or in flight (`policy.queued_prefill_tokens` takes the latter off).
A decode worker's numbers go stale the same way by state slots: a request the last poll counted whose stream has
ended gave its slot back, so such slots are added to the last poll's free ones until the next poll answers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from baton.router.policy import Role, WorkerLoad


@dataclass(frozen=True)
class LoadSnapshot:
    outstanding_prefill_tokens: int = 0
    free_state_slots: int = 0
    free_kv_blocks: int = 0


@dataclass(frozen=True)
class _Sent:
    epoch: int
    prompt_tokens: int
    prefill_tokens: int  # of them, the ones this worker computes (a decode node: none past token N with a handle)
    # In the worker's own numbers from a poll begun at `epoch` on: prefill requests from when they are sent, decode
    # requests from their first token (`acknowledged`).
    acknowledged: bool = True


class LoadTracker:
    def __init__(self, role: Role) -> None:
        self.role = role
        # Tokens per KV block of the worker (from its Info); 0 until known, and then blocks are not estimated.
        self.block_size = 0
        # Its step budget (max_num_batched_tokens, from its Info); 0 until known.
        self.step_tokens = 0
        self._epoch = 0
        self._snapshot = LoadSnapshot()
        self._snapshot_epoch = 0
        self._sent: dict[str, _Sent] = {}
        # Prefill tokens of requests the last poll counted that have returned since (prefill workers).
        self._returned = 0
        # State slots of requests the last poll counted that have finished since (decode workers).
        self._returned_slots = 0

    def begin_poll(self) -> int:
        """Call right before sending `Load`; pass the result to `end_poll` with the answer."""
        self._epoch += 1
        return self._epoch

    def end_poll(self, epoch: int, snapshot: LoadSnapshot) -> None:
        # An answer older than the one we hold describes an older state: keep the newer one.
        if epoch >= self._snapshot_epoch:
            self._snapshot, self._snapshot_epoch = snapshot, epoch
            self._returned = 0
            self._returned_slots = 0

    def add(self, request_id: str, prompt_tokens: int, prefill_tokens: int | None = None) -> None:
        """A request sent: its prompt tokens, and of them the ones the worker prefills (default all)."""
        self._sent[request_id] = _Sent(self._epoch, prompt_tokens,
                                       prompt_tokens if prefill_tokens is None else prefill_tokens,
                                       acknowledged=self.role is Role.PREFILL)

    def acknowledged(self, request_id: str) -> None:
        """A decode request's first token arrived: the worker holds it in a state slot, so a poll begun from now
        on counts it."""
        sent = self._sent.get(request_id)
        if sent is not None and not sent.acknowledged:
            self._sent[request_id] = replace(sent, epoch=self._epoch, acknowledged=True)

    def remove(self, request_id: str) -> None:
        """A request answered (a prefill worker: its Prefill call returned, done or failed)."""
        sent = self._sent.pop(request_id, None)
        if sent is None or not sent.acknowledged or sent.epoch >= self._snapshot_epoch:
            return
        # The last poll counted it; it is no longer there.
        if self.role is Role.PREFILL:
            self._returned += sent.prefill_tokens
        else:
            self._returned_slots += 1

    @property
    def in_flight(self) -> int:
        return len(self._sent)

    def load(self, healthy: bool) -> WorkerLoad:
        unseen = [s for s in self._sent.values() if not s.acknowledged or s.epoch >= self._snapshot_epoch]
        snap = self._snapshot
        if self.role is Role.PREFILL:
            tokens = sum(s.prompt_tokens for s in unseen)
            polled = max(0, snap.outstanding_prefill_tokens - self._returned)
            return WorkerLoad(healthy, outstanding_prefill_tokens=polled + tokens, step_tokens=self.step_tokens)
        bs = self.block_size
        blocks = sum(-(-s.prompt_tokens // bs) for s in unseen) if bs > 0 else 0
        return WorkerLoad(healthy, free_state_slots=snap.free_state_slots + self._returned_slots - len(unseen),
                          free_kv_blocks=snap.free_kv_blocks - blocks,
                          outstanding_prefill_tokens=snap.outstanding_prefill_tokens
                          + sum(s.prefill_tokens for s in unseen), step_tokens=self.step_tokens)
