"""Worker discovery: the addresses a worker pool should hold right now, per role.

- `StaticDiscovery`: the `--prefill` / `--decode` addresses; never changes.
- `DnsDiscovery`: `NAME:PORT` of a headless Service (Kubernetes gives one A/AAAA record per ready pod).
  Every record is one worker on PORT; the name is resolved again every `refresh_s`, so pods that join or
  leave are picked up without restarting the router. A failed lookup keeps the current set (a DNS hiccup
  must not empty the pool; workers that are really gone fail their Load polls and leave rotation anyway).
- `RayDiscovery`: the named actors `prefill-*` / `decode-*` of a Ray namespace (`baton ray up` starts them,
  cli/ray_cmd.py), each asked for the gRPC `HOST:PORT` of the server process it runs (None until that
  server answers). Ray is imported only when this discovery is used (`pip install baton-serve[ray]`).
- `UnionDiscovery`: static addresses, a DNS name and Ray actors together.

`WorkerPool` (router/workers.py) asks its discovery at start and then every `refresh_s` seconds; new
addresses get a channel and are polled, vanished ones stop getting new requests and their channels close
once their in-flight requests have ended.
"""

from __future__ import annotations

import abc
import argparse
import asyncio
import dataclasses
import logging
import socket
import threading
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from baton.router.config import RouterConfig
from baton.router.policy import Role

log = logging.getLogger(__name__)

# (host, port) -> the IP addresses `host` resolves to now.
Resolver = Callable[[str, int], Awaitable[Iterable[str]]]


class Discovery(abc.ABC):
    # Seconds between lookups; None: the answer never changes, so it is looked up once, at start.
    refresh_s: float | None = None

    @abc.abstractmethod
    async def addresses(self) -> frozenset[str]:
        """The current 'HOST:PORT' addresses. Raises (OSError for a failed lookup) when the answer is not
        known: the pool then keeps the set it has."""

    @abc.abstractmethod
    def describe(self) -> str:
        ...


class StaticDiscovery(Discovery):
    def __init__(self, addrs: Iterable[str]) -> None:
        self.addrs = frozenset(addrs)

    async def addresses(self) -> frozenset[str]:
        return self.addrs

    def describe(self) -> str:
        return f"{len(self.addrs)} static"


async def getaddrinfo_resolver(host: str, port: int) -> list[str]:
    """Every A and AAAA record of `host`, through the system resolver (without blocking the loop)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def join_host_port(ip: str, port: int) -> str:
    """An address gRPC accepts: IPv6 literals go in brackets."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


class DnsDiscovery(Discovery):
    def __init__(self, target: str, refresh_s: float, *, resolve: Resolver | None = None,
                 timeout_s: float = 5.0) -> None:
        host, _, port = target.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"DNS target: expected 'NAME:PORT' with PORT in [1, 65535], got {target!r}")
        self.host, self.port = host.strip("[]"), int(port)
        self.refresh_s = refresh_s
        self.timeout_s = timeout_s
        self._resolve = resolve or getaddrinfo_resolver

    async def addresses(self) -> frozenset[str]:
        # getaddrinfo runs in a thread and may hang on a dead resolver: TimeoutError is an OSError too.
        async with asyncio.timeout(self.timeout_s):
            ips = await self._resolve(self.host, self.port)
        return frozenset(join_host_port(ip, self.port) for ip in ips)

    def describe(self) -> str:
        return f"DNS {self.host}:{self.port} (every {self.refresh_s:g} s)"


class UnionDiscovery(Discovery):
    def __init__(self, parts: Sequence[Discovery]) -> None:
        self.parts = tuple(parts)
        refresh = [p.refresh_s for p in self.parts if p.refresh_s is not None]
        self.refresh_s = min(refresh) if refresh else None

    async def addresses(self) -> frozenset[str]:
        answers = await asyncio.gather(*(p.addresses() for p in self.parts))
        return frozenset().union(*answers)

    def describe(self) -> str:
        return " + ".join(p.describe() for p in self.parts)


# The named actors of one namespace -> [(name, 'HOST:PORT' or None)] for those whose name starts with prefix.
RayLookup = Callable[[str, str, float], list[tuple[str, str | None]]]

_ray_init_lock = threading.Lock()


def ray_actor_lookup(address: str | None) -> RayLookup:
    """Lists the named actors of a namespace through Ray and calls `address()` on those of one role."""

    def lookup(namespace: str, prefix: str, timeout_s: float) -> list[tuple[str, str | None]]:
        import ray  # optional dependency: only a router started with --ray-namespace needs it

        with _ray_init_lock:
            if not ray.is_initialized():
                ray.init(address=address or "auto", namespace=namespace, log_to_driver=False,
                         logging_level=logging.WARNING)
        names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                       if a["namespace"] == namespace and a["name"].startswith(prefix))
        refs = {}
        for name in names:
            try:
                refs[name] = ray.get_actor(name, namespace=namespace).address.remote()
            except ValueError:  # gone between the listing and the lookup
                continue
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        out: list[tuple[str, str | None]] = []
        for name, ref in refs.items():
            addr = None
            if ref in ready:
                try:
                    addr = ray.get(ref)
                except ray.exceptions.RayError:  # the actor died: no longer a worker
                    addr = None
            out.append((name, addr))
        return out

    return lookup


class RayDiscovery(Discovery):
    """Workers are the named actors `<role>-*` of a Ray namespace that report a server address."""

    def __init__(self, namespace: str, role: Role, refresh_s: float, *, address: str | None = None,
                 lookup: RayLookup | None = None, timeout_s: float = 5.0) -> None:
        self.namespace, self.prefix = namespace, f"{role.value}-"
        self.refresh_s = refresh_s
        self.timeout_s = timeout_s
        self._lookup = lookup or ray_actor_lookup(address)

    async def addresses(self) -> frozenset[str]:
        # Ray's client calls block: run them in a thread. A hung cluster raises TimeoutError (an OSError).
        # The first call also connects to the cluster (several seconds), hence the generous deadline.
        async with asyncio.timeout(self.timeout_s * 6):
            found = await asyncio.to_thread(self._lookup, self.namespace, self.prefix, self.timeout_s)
        return frozenset(addr for _, addr in found if addr)

    def describe(self) -> str:
        return f"Ray actors {self.namespace}/{self.prefix}* (every {self.refresh_s:g} s)"


def discovery_for(config: RouterConfig, role: Role, resolve: Resolver | None = None,
                  ray_lookup: RayLookup | None = None) -> Discovery:
    """The discovery of one role's workers: its static addresses, its DNS name, Ray actors, or several."""
    static = config.prefill_addrs if role is Role.PREFILL else config.decode_addrs
    dns = config.prefill_dns if role is Role.PREFILL else config.decode_dns
    parts: list[Discovery] = []
    if dns is not None:
        parts.append(DnsDiscovery(dns, config.dns_refresh_s, resolve=resolve, timeout_s=config.control_timeout_s))
    if config.ray_namespace is not None:
        parts.append(RayDiscovery(config.ray_namespace, role, config.ray_refresh_s, address=config.ray_address,
                                  lookup=ray_lookup, timeout_s=config.control_timeout_s))
    if not parts:
        return StaticDiscovery(static)
    if static:
        parts.insert(0, StaticDiscovery(static))
    return UnionDiscovery(parts) if len(parts) > 1 else parts[0]


# ---- command line ---------------------------------------------------------------------------------
def _default(name: str) -> Any:
    return next(f.default for f in dataclasses.fields(RouterConfig) if f.name == name)


def add_discovery_args(parser: argparse.ArgumentParser) -> None:
    """The discovery and health flags of `python -m baton.router.server`; `discovery_from_args` reads them."""
    g = parser.add_argument_group("worker discovery and health")
    g.add_argument("--prefill-dns", default=None, metavar="NAME:PORT",
                   help="a headless Service name: each of its A/AAAA records is a prefill worker on PORT "
                        "(with or without --prefill)")
    g.add_argument("--decode-dns", default=None, metavar="NAME:PORT",
                   help="the same for decode workers (then --decode may be left out)")
    g.add_argument("--dns-refresh-s", type=float, default=_default("dns_refresh_s"),
                   help="seconds between DNS lookups: workers joining or leaving are picked up this fast")
    g.add_argument("--unhealthy-after", type=int, default=_default("unhealthy_after"), metavar="N",
                   help="failed Load polls in a row that take a worker out of rotation (one success puts it back)")
    g.add_argument("--poll-timeout", type=float, default=_default("poll_timeout_s"), metavar="S",
                   help="deadline of a Load poll: a worker that lets --unhealthy-after polls in a row pass it "
                        "unanswered has stopped answering (its requests are retried elsewhere or ended)")
    g.add_argument("--ray-namespace", default=None, metavar="NS",
                   help="workers are the named Ray actors prefill-* / decode-* of this namespace (baton ray up)")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="the Ray cluster of --ray-namespace (default: auto)")
    g.add_argument("--ray-refresh-s", type=float, default=_default("ray_refresh_s"),
                   help="seconds between Ray actor lookups")


def discovery_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """RouterConfig fields from the flags `add_discovery_args` added."""
    return {"prefill_dns": args.prefill_dns, "decode_dns": args.decode_dns, "dns_refresh_s": args.dns_refresh_s,
            "unhealthy_after": args.unhealthy_after, "poll_timeout_s": args.poll_timeout,
            "ray_namespace": args.ray_namespace,
            "ray_address": args.ray_address, "ray_refresh_s": args.ray_refresh_s}
