"""PEM files named by a flag (certificates, keys, CA bundles), read once at start with an error naming the flag."""

from __future__ import annotations

from pathlib import Path


def read_pem(flag: str, path: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{flag}: expected a readable PEM file, got {path!r} ({e})") from e
    if b"-----BEGIN " not in data:
        raise ValueError(f"{flag}: expected a PEM file, got {path!r} without a '-----BEGIN' block")
    return data
