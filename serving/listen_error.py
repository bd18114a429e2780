"""A server that cannot bind one of its ports raises `CannotListen` and exits with `CANNOT_LISTEN_EXIT`.

A launcher that picked the port free (`baton ray up`) may lose it to another process before the server
binds it; this exit code tells it to retry with new ports instead of reporting a crash.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

CANNOT_LISTEN_EXIT = 98  # EADDRINUSE's errno on Linux


class CannotListen(OSError):
    """A server could not bind HOST:PORT (taken, or not an address of this machine)."""


def run_main(main: Callable[[], int]) -> int:
    """A server's `__main__`: runs `main`; a port it cannot bind ends it with one line and `CANNOT_LISTEN_EXIT`."""
    try:
        return main()
    except CannotListen as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return CANNOT_LISTEN_EXIT
