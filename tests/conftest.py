"""Suite-wide rules: tests marked `gpu` are skipped where CUDA is absent (CI has no GPU), and there the
Triton kernels run in Triton's interpreter (on CPU tensors), switched on before any module imports them. Tests
marked `interpreter` (Triton kernels on CPU tensors) are skipped where CUDA is present, unless also marked `gpu`.
The interpreter patches `triton.language` once a launch, not again at every helper call
(tests/interpreter_patch_once.py: the same kernels, about a quarter less time), without the integer overflow checks
that compiled kernels run only in debug mode (tests/interpreter_fast_paths.py). Every cluster a test starts
(routers, nodes, `baton up`) shares one cluster secret, generated here, as a deployment's processes do.
Tests of `PURE_CPU_MODULES` are marked `pure_cpu`: engine and benchmark-script work and the container install
script's venv, with no ports, servers or clocks, which `make test` runs two at a time beside the interpreter tests."""

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
        from tests import interpreter_fast_paths, interpreter_patch_once

        interpreter_patch_once.install()
        interpreter_fast_paths.install()


PURE_CPU_MODULES = frozenset({
    "test_alloc_bench", "test_allocator", "test_async_scheduling", "test_container_install", "test_cuda_graphs",
    "test_engine", "test_engine_bench", "test_exactness", "test_fp8_checkpoint", "test_fp8_experts", "test_fp8_gemm_bench", "test_fp8_linear", "test_fp8_quality", "test_gdn_bench", "test_gemv_bench", "test_greedy_tokens",
    "test_launch_probe", "test_loader", "test_make_model", "test_memory_budget", "test_mtp_bench", "test_mtp_module",
    "test_prefix_cache", "test_prefix_cache_sim",
    "test_ops_gated_delta", "test_qwen3_5_checkpoint", "test_qwen3_5_exactness", "test_qwen3_5_mtp", "test_rejection_sampler",
    "test_sampling", "test_scheduler", "test_spec_bench", "test_spec_decode", "test_step_ops", "test_step_profile",
    "test_tail_keep", "test_tokenizer", "test_transfer_shard_map",
    "test_structured_output", "test_triton_sm90_compile",
})

# Modules whose clusters' routing is checked against poll timing (`serial`): `make test` runs them alone, after the
# other server tests, which it runs two at a time.
SERIAL_MODULES = frozenset({"test_router_affinity_cluster"})


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        # Compiled kernels refuse CPU tensors, and the interpreter is off where CUDA is present.
        skip = pytest.mark.skip(reason="Triton kernels on CPU tensors: the interpreter is on only without CUDA")
        marker = "interpreter"
    else:
        skip = pytest.mark.skip(reason="needs a CUDA device")
        marker = "gpu"
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1]
        if module in PURE_CPU_MODULES:
            item.add_marker(pytest.mark.pure_cpu)
        if module in SERIAL_MODULES:
            item.add_marker(pytest.mark.serial)
        # (A module may mark all its tests `interpreter`: its `gpu` ones still run on a GPU machine.)
        if marker in item.keywords and not (marker == "interpreter" and "gpu" in item.keywords):
            item.add_marker(skip)
