"""Regenerate the committed Python stubs of Baton's `.proto` files: `python -m baton.proto.codegen [--check]`.

`PROTOS` are paths under `proto/`: Baton's API (`v1/`) and the standard gRPC protocols it serves (`grpc/`:
health checking, server reflection). Each file's stubs sit beside it. The stubs are committed (no build step
needs grpcio-tools); `tests/test_proto_fresh.py` fails when they differ from a fresh generation, so a `.proto`
edit without a regeneration never lands.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from importlib import resources
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
V1_DIR = PROTO_DIR / "v1"
PROTOS = ("v1/generation.proto", "v1/worker.proto", "grpc/health/v1/health.proto",
          "grpc/reflection/v1/reflection.proto", "grpc/reflection/v1alpha/reflection.proto")
# The import path the .proto files see each other under. Staging them at baton/proto/ makes protoc write
# `from baton.proto.v1 import generation_pb2`, which resolves once installed under `baton.`.
PACKAGE_PATH = Path("baton", "proto")


def stub_names() -> list[str]:
    """The stubs' paths under `proto/`."""
    return [str(Path(p).with_name(f"{Path(p).stem}{suffix}")) for p in PROTOS
            for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]


def generate(out_dir: Path) -> None:
    """Write every stub of `PROTOS` into `out_dir`, at the paths of `stub_names()`."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory(prefix="baton-protoc-") as tmp:
        src, gen = Path(tmp, "src"), Path(tmp, "gen")
        gen.mkdir()
        for name in PROTOS:
            (src / PACKAGE_PATH / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(PROTO_DIR / name, src / PACKAGE_PATH / name)
        # grpc_tools ships the well-known types (google/protobuf/*.proto); protoc does not find them alone.
        well_known = resources.files("grpc_tools") / "_proto"
        args = ["grpc_tools.protoc", f"-I{src}", f"-I{well_known}", f"--python_out={gen}", f"--pyi_out={gen}",
                f"--grpc_python_out={gen}", *(str(PACKAGE_PATH / name) for name in PROTOS)]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        for name in stub_names():
            (out_dir / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(gen / PACKAGE_PATH / name, out_dir / name)


def stale_stubs(stubs_dir: Path = PROTO_DIR) -> list[str]:
    """Paths of the stubs under `stubs_dir` that differ from (or are missing next to) a fresh generation."""
    with tempfile.TemporaryDirectory(prefix="baton-stubs-") as tmp:
        fresh = Path(tmp)
        generate(fresh)
        return [name for name in stub_names()
                if not (stubs_dir / name).is_file() or (stubs_dir / name).read_bytes() != (fresh / name).read_bytes()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m baton.proto.codegen", description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a committed stub is stale")
    p.add_argument("--stubs-dir", type=Path, default=PROTO_DIR,
                   help="the proto/ folder whose stubs to check (--check)")
    a = p.parse_args(argv)
    if a.check:
        stale = stale_stubs(a.stubs_dir)
        for name in stale:
            print(f"stale: proto/{name}", file=sys.stderr)
        if stale:
            print("run `python -m baton.proto.codegen` and commit the result", file=sys.stderr)
        return 1 if stale else 0
    generate(PROTO_DIR)
    for name in stub_names():
        print(f"wrote proto/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
