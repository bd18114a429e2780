"""`baton secret [--out FILE]`: print (or write, readable by its owner only) a new cluster secret."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from baton.proto.auth import CLUSTER_SECRET_ENV, ClusterCredential


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("secret", help=f"print a new cluster secret (for ${CLUSTER_SECRET_ENV} or --cluster-secret-file)")
    p.add_argument("--out", type=Path, default=None,
                   help="write it to this file (mode 0600, refused if the file exists) instead of printing it")
    p.set_defaults(run=run)


def run(a: argparse.Namespace) -> int:
    text = ClusterCredential.generate().encoded()
    if a.out is None:
        print(text)
        return 0
    try:
        fd = os.open(a.out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ValueError(f"--out: expected a path with no file yet, got {str(a.out)!r} (an existing secret is "
                         "never overwritten)") from None
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    return 0
