"""Regenerate the committed Python stubs of `proto/v1/*.proto`: `python -m baton.proto.codegen [--check]`.

The stubs are committed (no build step needs grpcio-tools); `tests/test_proto_fresh.py` fails when they
differ from a fresh generation, so a `.proto` edit without a regeneration never lands.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from importlib import resources
from pathlib import Path

V1_DIR = Path(__file__).resolve().parent / "v1"
PROTOS = ("generation.proto", "worker.proto")
# The import path the .proto files see each other under. Staging them at baton/proto/v1/ makes protoc
# write `from baton.proto.v1 import generation_pb2`, which resolves once installed under `baton.`.
PACKAGE_PATH = Path("baton", "proto", "v1")


def stub_names() -> list[str]:
    return [f"{Path(p).stem}{suffix}" for p in PROTOS for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]


def generate(out_dir: Path) -> None:
    """Write every stub of `PROTOS` into `out_dir` (flat, as they sit in `proto/v1/`)."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory(prefix="baton-protoc-") as tmp:
        src, gen = Path(tmp, "src"), Path(tmp, "gen")
        (src / PACKAGE_PATH).mkdir(parents=True)
        gen.mkdir()
        for name in PROTOS:
            shutil.copyfile(V1_DIR / name, src / PACKAGE_PATH / name)
        # grpc_tools ships the well-known types (google/protobuf/*.proto); protoc does not find them alone.
        well_known = resources.files("grpc_tools") / "_proto"
        args = ["grpc_tools.protoc", f"-I{src}", f"-I{well_known}", f"--python_out={gen}", f"--pyi_out={gen}",
                f"--grpc_python_out={gen}", *(str(PACKAGE_PATH / name) for name in PROTOS)]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in stub_names():
            shutil.copyfile(gen / PACKAGE_PATH / name, out_dir / name)


def stale_stubs(stubs_dir: Path = V1_DIR) -> list[str]:
    """Names of the stubs in `stubs_dir` that differ from (or are missing next to) a fresh generation."""
    with tempfile.TemporaryDirectory(prefix="baton-stubs-") as tmp:
        fresh = Path(tmp)
        generate(fresh)
        return [name for name in stub_names()
                if not (stubs_dir / name).is_file() or (stubs_dir / name).read_bytes() != (fresh / name).read_bytes()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m baton.proto.codegen", description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a committed stub is stale")
    p.add_argument("--stubs-dir", type=Path, default=V1_DIR, help="where the stubs to check are (--check)")
    a = p.parse_args(argv)
    if a.check:
        stale = stale_stubs(a.stubs_dir)
        for name in stale:
            print(f"stale: proto/v1/{name}", file=sys.stderr)
        if stale:
            print("run `python -m baton.proto.codegen` and commit the result", file=sys.stderr)
        return 1 if stale else 0
    generate(V1_DIR)
    for name in stub_names():
        print(f"wrote proto/v1/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
