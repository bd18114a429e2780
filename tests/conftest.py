"""Suite-wide rules: tests marked `gpu` are skipped where CUDA is absent (CI has no GPU), and there the
Triton kernels run in Triton's interpreter (on CPU tensors), switched on before any module imports them. Tests
marked `interpreter` (Triton kernels on CPU tensors) are skipped where CUDA is present, unless also marked `gpu`.
The interpreter patches `triton.language` once a launch, not again at every helper call
(tests/interpreter_patch_once.py: the same kernels, about a quarter less time). Every cluster a test starts
(routers, nodes, `baton up`) shares one cluster secret, generated here, as a deployment's processes do."""

import os

import pytest
import torch

from baton.proto.auth import CLUSTER_SECRET_ENV, ClusterCredential

os.environ.setdefault(CLUSTER_SECRET_ENV, ClusterCredential.generate().encoded())

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    try:
        import triton  # noqa: F401
    except ImportError:  # (tests that need Triton skip themselves)
        pass
    else:
        from tests.interpreter_patch_once import install

        install()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        # Compiled kernels refuse CPU tensors, and the interpreter is off where CUDA is present.
        skip = pytest.mark.skip(reason="Triton kernels on CPU tensors: the interpreter is on only without CUDA")
        marker = "interpreter"
    else:
        skip = pytest.mark.skip(reason="needs a CUDA device")
        marker = "gpu"
    for item in items:
        # (A module may mark all its tests `interpreter`: its `gpu` ones still run on a GPU machine.)
        if marker in item.keywords and not (marker == "interpreter" and "gpu" in item.keywords):
            item.add_marker(skip)
