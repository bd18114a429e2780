"""Helpers of the drain and restart tests: long Generate streams through a router on threads (raw gRPC, no client
retries, so that every status is seen), and the TCP ports a process listens on (from /proc)."""

from __future__ import annotations

import ipaddress
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from baton.proto.v1 import generation_pb2 as gen
from baton.proto.v1 import generation_pb2_grpc as gen_grpc

LENGTH = gen.FINISH_REASON_LENGTH


@dataclass
class StreamResult:
    tokens: int = 0
    finish: int = 0
    # "OK", or the gRPC status code's name and details of a stream that failed.
    status: str = ""
    details: str = ""


@dataclass
class Streams:
    """`n` streams of `max_tokens` tokens each (ignore_eos), started at once; `started` is set once every
    stream has received a token (or one failed before)."""

    addr: str
    n: int
    max_tokens: int
    results: list[StreamResult] = field(default_factory=list)
    started: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.results = [StreamResult() for _ in range(self.n)]
        self._first = 0
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._one, args=(i,), daemon=True) for i in range(self.n)]
        for t in self._threads:
            t.start()

    def _seen_first(self) -> None:
        with self._lock:
            self._first += 1
            if self._first == self.n:
                self.started.set()

    def _one(self, i: int) -> None:
        r = self.results[i]
        req = gen.GenerateRequest(token_ids=gen.TokenIds(ids=[3 + i % 50, 4, 5, 6, 7, 8, 9, 10, 11]),
                                  sampling=gen.SamplingParams(max_tokens=self.max_tokens, ignore_eos=True))
        with grpc.insecure_channel(self.addr) as ch:
            try:
                for m in gen_grpc.GenerationStub(ch).Generate(req, timeout=120):
                    if m.token_ids and not r.tokens:
                        self._seen_first()
                    r.tokens += len(m.token_ids)
                    r.finish = m.finish_reason or r.finish
                r.status = "OK"
            except grpc.RpcError as e:
                r.status, r.details = e.code().name, e.details() or ""
                if not r.tokens:
                    self.started.set()

    def join(self, timeout: float) -> list[StreamResult]:
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self._threads), "streams still running"
        return self.results

    def all_finished(self) -> bool:
        return all(r.status == "OK" and r.finish == LENGTH and r.tokens == self.max_tokens for r in self.results)


def listening_addresses(pid: int) -> list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]]:
    """(address, port) of every TCP socket process `pid` listens on, IPv4 and IPv6."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table, size in (("tcp", 4), ("tcp6", 16)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                continue
            hex_addr, hex_port = cols[1].split(":")
            raw = bytes.fromhex(hex_addr)
            # /proc prints the address as 32-bit words in host (little-endian) order.
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, size, 4))
            addr = ipaddress.ip_address(raw)
            if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
                addr = addr.ipv4_mapped
            out.append((addr, int(hex_port, 16)))
    return out
