"""Where a node's transfer listener binds: UCX's TCP transport listens on every network interface it uses, so a
node started with `--host 127.0.0.1` would still accept transfer connections from the network. Before NIXL starts,
`limit_transfer_interfaces(host)` restricts UCX to the interface that holds `host` (and keeps the RDMA devices,
which open no TCP listener), unless the user chose devices with UCX_NET_DEVICES or `host` is a wildcard.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from collections.abc import MutableMapping
from pathlib import Path

log = logging.getLogger("baton.node")

UCX_NET_DEVICES = "UCX_NET_DEVICES"


def host_addresses(host: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The addresses `host` (an address or a name) stands for; [] when it does not resolve."""
    try:
        return [ipaddress.ip_address(host.strip("[]"))]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return []
    return sorted({ipaddress.ip_address(i[4][0].split("%", 1)[0]) for i in infos}, key=str)


def interface_addresses() -> dict[str, set[ipaddress.IPv4Address | ipaddress.IPv6Address]]:
    """Linux network interfaces and the addresses they hold (IPv4 through ioctl, IPv6 from /proc/net/if_inet6)."""
    import fcntl
    import struct

    out: dict[str, set] = {name: set() for _, name in socket.if_nameindex()}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in out:
            try:
                # SIOCGIFADDR: the interface's IPv4 address, bytes 20..24 of the returned ifreq.
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
                out[name].add(ipaddress.IPv4Address(raw[20:24]))
            except OSError:
                pass
    with open("/proc/net/if_inet6") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6 and fields[5] in out:
                out[fields[5]].add(ipaddress.IPv6Address(bytes.fromhex(fields[0])))
    return out


def rdma_devices(root: Path = Path("/sys/class/infiniband")) -> list[str]:
    """UCX names (`mlx5_0:1`) of this host's RDMA ports."""
    if not root.is_dir():
        return []
    return sorted(f"{dev.name}:{port.name}" for dev in root.iterdir() for port in (dev / "ports").glob("*"))


def transfer_devices(host: str) -> str | None:
    """The UCX_NET_DEVICES value that keeps a node bound to `host`, or None to leave UCX's choice (a wildcard
    host, or one no interface holds)."""
    addrs = host_addresses(host)
    if not addrs or any(a.is_unspecified for a in addrs):
        return None
    try:
        held = interface_addresses()
    except OSError:
        return None
    names = sorted(name for name, have in held.items() if have & set(addrs))
    if not names:
        return None
    # Loopback devices carry no RDMA traffic: a loopback-bound node keeps nothing but them.
    rdma = [] if all(a.is_loopback for a in addrs) else rdma_devices()
    return ",".join([*names, *rdma])


def limit_transfer_interfaces(host: str, environ: MutableMapping[str, str] | None = None) -> str | None:
    """Sets UCX_NET_DEVICES for a node bound to `host` (see the module docstring) unless already set; returns the
    value in effect (None: UCX's default, every interface)."""
    env = os.environ if environ is None else environ
    if env.get(UCX_NET_DEVICES):
        return env[UCX_NET_DEVICES]
    devices = transfer_devices(host)
    if devices is None:
        log.info("transfer listener: UCX uses every interface (--host %s)", host)
        return None
    env[UCX_NET_DEVICES] = devices
    return devices
