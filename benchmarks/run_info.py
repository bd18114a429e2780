"""What a benchmark records about its run: the commit it measured and the device it ran on."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch


def git_commit() -> str:
    """Short HEAD of the checkout, "+dirty" with uncommitted changes, "unknown" without git. `BATON_COMMIT`, when
    set, is taken as is: a copy of the tree whose git metadata lags behind it (the GPU machine's) names the
    commit it was copied from that way."""
    if os.environ.get("BATON_COMMIT"):
        return os.environ["BATON_COMMIT"]
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
