"""Suite-wide rules: tests marked `gpu` are skipped where CUDA is absent (CI has no GPU), and there the
Triton kernels run in Triton's interpreter (on CPU tensors), switched on before any module imports them."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
