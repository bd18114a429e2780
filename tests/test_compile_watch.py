"""The record of Triton kernel specializations (`engine/compile_watch.py`): silent while the warm-up meets them, then a
log line for each new one naming the arguments in which it differs from the nearest one met before. Off the GPU
Triton never calls the hook (the interpreter compiles nothing), so those tests call it as Triton does; the `gpu`
test launches a real kernel."""

from types import SimpleNamespace

import pytest
import torch

from baton.engine.compile_watch import CompileWatch, KernelVariant, spec_text, watch_compiles

triton = pytest.importorskip("triton")

PARAMS = ("x_ptr", "n", "BLOCK")


def hook_kwargs(specs: list[tuple[str, object]], num_warps: int = 4) -> dict:
    """The keyword arguments Triton's `_call_hook` passes for a kernel `toy(x_ptr, n, BLOCK: constexpr)`, the
    parameters specialized as `specs` says (the binder's (type, "D" or "") per parameter, ("constexpr", value))."""
    jit = SimpleNamespace(fn=SimpleNamespace(__qualname__="toy"), params=[SimpleNamespace(name=n) for n in PARAMS])
    signature = {n: ty for n, (ty, _) in zip(PARAMS, specs, strict=True)}
    constants = {(i,): v for i, (ty, v) in enumerate(specs) if ty == "constexpr"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, (ty, v) in enumerate(specs) if ty != "constexpr" and v == "D"}
    key = str(specs) + "options"  # a string, as Triton's is
    return dict(key=key, repr="toy[...]", fn=SimpleNamespace(jit_function=jit),
                compile={"key": key, "signature": signature, "constants": constants, "configs": [attrs],
                         "num_warps": num_warps, "num_stages": 3}, is_manual_warmup=False, already_compiled=False)


def test_spec_text():
    assert spec_text(("i32", "D")) == "i32 D"
    assert spec_text(("*fp32", "")) == "*fp32"
    assert spec_text(("constexpr", 64)) == "=64"


def test_variants_met_after_arming_are_logged_with_their_differences(caplog):
    watch = CompileWatch()
    with caplog.at_level("WARNING", logger="baton.engine.compile_watch"):
        watch(hook_kwargs([("*fp32", "D"), ("i32", "D"), ("constexpr", 64)]))
        watch(hook_kwargs([("*fp32", "D"), ("i32", ""), ("constexpr", 64)]))
        assert caplog.text == "" and len(watch.seen) == 2 and watch.later == 0  # the warm-up's: recorded only
        watch.armed = True
        watch(hook_kwargs([("*fp32", "D"), ("i32", "D"), ("constexpr", 128)], num_warps=8))
    assert watch.later == 1
    line = caplog.records[-1].getMessage()
    assert "toy" in line and "first met after the warm-up" in line
    # Nearest: the first one (one parameter and the options differ), not the second (two parameters differ).
    assert "BLOCK: =64 -> =128" in line and "n: i32" not in line and "num_warps=4, num_stages=3 ->" in line


def test_a_kernel_not_met_before_is_named_as_such(caplog):
    watch = CompileWatch(armed=True)
    with caplog.at_level("WARNING", logger="baton.engine.compile_watch"):
        watch(hook_kwargs([("*fp32", "D"), ("i32", "D"), ("constexpr", 64)]))
    assert "a kernel not met before" in caplog.text


def test_hook_arguments_of_another_shape_still_log_the_repr(caplog):
    watch = CompileWatch(armed=True)
    with caplog.at_level("WARNING", logger="baton.engine.compile_watch"):
        watch({"repr": "toy[num_warps=4](n: i32)", "fn": None})
    assert "toy[num_warps=4](n: i32)" in caplog.text and watch.later == 1


def test_the_hook_chains_the_one_set_before_and_installs_once(monkeypatch):
    calls = []

    def earlier(**kw):
        calls.append(kw["repr"])
        return True  # the earlier hook's answer (skip the compile) passes through

    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", earlier)
    watch = watch_compiles()
    assert watch is not None and watch_compiles() is watch  # a second warm-up reuses it
    hook = triton.knobs.runtime.jit_cache_hook
    assert hook(**hook_kwargs([("*fp32", "D"), ("i32", "D"), ("constexpr", 64)])) is True
    assert calls == ["toy[...]"] and len(watch.seen) == 1
    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", None)
    fresh = watch_compiles()
    assert fresh is not watch and triton.knobs.runtime.jit_cache_hook(**hook_kwargs([("i32", "")] * 3)) is False


def test_differences_of_other_signatures():
    a = KernelVariant("k", (("n", "i32"),), "o")
    b = KernelVariant("k", (("n", "i32"), ("m", "i32")), "o")
    assert a.differences(b) == ["signature: 2 -> 1 parameters"]
    assert a.nearest([a]) is None and a.nearest([b]) is b


@pytest.mark.gpu
def test_gpu_a_real_launch_is_recorded_then_logged(caplog):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import triton.language as tl

    @triton.jit
    def _watch_probe_kernel(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)

    watch = watch_compiles()
    assert watch is not None
    watch.armed = False
    x = torch.zeros(64, device="cuda")
    _watch_probe_kernel[(1,)](x, 32, BLOCK=64)
    watch.armed = True
    with caplog.at_level("WARNING", logger="baton.engine.compile_watch"):
        _watch_probe_kernel[(1,)](x, 32, BLOCK=64)  # met before: no compile, no log
        assert "_watch_probe_kernel" not in caplog.text
        _watch_probe_kernel[(1,)](x, 33, BLOCK=64)  # 33 is not divisible by 16: a new specialization
    assert "_watch_probe_kernel" in caplog.text and "n: i32 D -> i32" in caplog.text
    watch.armed = False
