"""`baton up` as a supervisor: a router or node process that exits is started again, after a backoff, on the
same ports (the router takes a restarted node back into rotation once it answers its Load polls).

Backoff per process: `initial_s`, doubling up to `max_s` while it keeps dying; a process that had stayed up
`reset_after_s` starts over at `initial_s`. Every restart is logged and counted in
`baton_up_process_restarts_total{process}`, which `baton up` serves on its own /metrics: the supervisor is the only
process that sees the restarts (a restarted process starts its own counters from zero).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter

from baton.cli.cluster import Cluster


@dataclass(frozen=True)
class RestartPolicy:
    initial_s: float = 1.0
    max_s: float = 30.0
    reset_after_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s:
            raise ValueError(f"initial_s, max_s: expected 0 < initial_s <= max_s, got {self.initial_s}, {self.max_s}")
        if not self.reset_after_s > 0:
            raise ValueError(f"reset_after_s: expected seconds > 0, got {self.reset_after_s}")


class Supervisor:
    def __init__(self, cluster: Cluster, policy: RestartPolicy = RestartPolicy(),
                 clock: Callable[[], float] = time.monotonic, registry: CollectorRegistry | None = None,
                 log: Callable[[str], None] = lambda line: print(line, flush=True)) -> None:
        self.cluster = cluster
        self.policy = policy
        self.clock = clock
        self.log = log
        self.registry = registry if registry is not None else CollectorRegistry()
        self.restarts = Counter("baton_up_process_restarts", "Router and node processes that exited and were "
                                "started again by `baton up`", ["process"], registry=self.registry)
        now = clock()
        self._up_since = {name: now for name in cluster.procs}
        self._delay = {name: policy.initial_s for name in cluster.procs}
        # Processes that exited, and when each is started again.
        self._due: dict[str, float] = {}
        self.counts = {name: 0 for name in cluster.procs}
        for name in cluster.procs:
            self.restarts.labels(process=name)

    def tick(self) -> None:
        """Notices the processes that exited and starts again those whose backoff has passed."""
        now = self.clock()
        for name, proc in list(self.cluster.procs.items()):
            if name in self._due:
                if now >= self._due[name]:
                    self._restart(name, now)
                continue
            code = proc.poll()
            if code is None:
                continue
            up = now - self._up_since[name]
            delay = self.policy.initial_s if up >= self.policy.reset_after_s else self._delay[name]
            self._delay[name] = min(delay * 2, self.policy.max_s)
            self._due[name] = now + delay
            self.log(f"baton up: {name} exited with code {code} after {up:.1f} s; starting it again in {delay:g} s")

    def _restart(self, name: str, now: float) -> None:
        del self._due[name]
        proc = self.cluster.respawn(name)
        self._up_since[name] = now
        self.restarts.labels(process=name).inc()
        self.counts[name] += 1
        self.log(f"baton up: started {name} again (pid {proc.pid}; restart {self.counts[name]} of it)")

    def waiting(self) -> dict[str, float]:
        """Processes waiting for their restart, and in how many seconds it comes."""
        now = self.clock()
        return {name: max(0.0, due - now) for name, due in self._due.items()}
