"""Which Triton kernel specializations a process meets, and a log of those met after the warm-up.

Triton compiles a kernel once per specialization: per constexpr value, per integer argument equal to 1 or
divisible by 16, per pointer 16-byte aligned or not. On a GPU each specialization a process meets for the first time
is a compile (or a load from Triton's disk cache) inside the step that meets it. The warm-up (`warm_up.py`) meets
the prefill path's before serving; `CompileWatch` records those, and once armed logs every later one with the
arguments in which it differs from the nearest one met before: what a wider warm-up, or a launch that specializes
alike whatever the batch, would cover.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

log = logging.getLogger("baton.engine.compile_watch")


def spec_text(spec: object) -> str:
    """Triton's per-argument specialization ("i32", "D"), ("constexpr", 4), ("*fp32", "") as short text."""
    if isinstance(spec, tuple) and len(spec) == 2:
        kind, attr = spec
        if kind == "constexpr":
            return f"={attr!r}"
        return f"{kind} {attr}".strip() if attr else str(kind)
    return str(spec)


@dataclass(frozen=True)
class KernelVariant:
    """One specialization of one kernel: its name, per parameter how Triton specializes the value (a type and "D"
    for divisible by 16 / aligned, a constexpr's value), and the launch options."""
    kernel: str
    params: tuple[tuple[str, str], ...]
    options: str

    def differences(self, other: KernelVariant) -> list[str]:
        """`name: other's -> this one's` for every parameter (and the options) where the two differ."""
        if len(self.params) != len(other.params):
            return [f"signature: {len(other.params)} -> {len(self.params)} parameters"]
        out = [f"{n}: {b} -> {a}" for (n, a), (_, b) in zip(self.params, other.params, strict=True) if a != b]
        if self.options != other.options:
            out.append(f"options: {other.options} -> {self.options}")
        return out

    def nearest(self, others: list[KernelVariant]) -> KernelVariant | None:
        """The variant of the same kernel among `others` that differs from this one in the fewest places."""
        same = [v for v in others if v.kernel == self.kernel and v != self]
        return min(same, key=lambda v: len(self.differences(v)), default=None)


def launch_options(num_warps: object, num_stages: object) -> str:
    """A variant's launch options as text (the part of them that a kernel's callers choose)."""
    return f"num_warps={num_warps}, num_stages={num_stages}"


def variant_of_hook_call(kw: dict) -> KernelVariant:
    """The variant a call of Triton's `jit_cache_hook` announces, from the compile request it passes: the signature
    (parameter -> type, "constexpr" for a constexpr), the constexprs' values and the attributes (16-byte alignment,
    divisibility by 16) by parameter index. (Its `key` is a string.)"""
    comp = kw["compile"]
    constants = comp.get("constants") or {}
    attrs = (comp.get("configs") or [{}])[0] or {}
    params = []
    for i, (name, ty) in enumerate(comp["signature"].items()):
        if ty == "constexpr":
            params.append((name, f"={constants.get((i,))!r}"))
        else:
            params.append((name, f"{ty} D" if attrs.get((i,)) else str(ty)))
    return KernelVariant(kw["fn"].jit_function.fn.__qualname__, tuple(params),
                         launch_options(comp.get("num_warps"), comp.get("num_stages")))


@dataclass
class CompileWatch:
    """Records every kernel specialization Triton announces through `jit_cache_hook` (chained after a hook set
    before it); once `armed`, logs each new one with its differences from the nearest one met before."""
    armed: bool = False
    seen: list[KernelVariant] = field(default_factory=list)
    later: int = 0  # variants met once armed

    def __call__(self, kw: dict) -> None:
        try:
            v = variant_of_hook_call(kw)
        except (AttributeError, KeyError, IndexError, TypeError):  # another Triton's hook arguments
            if self.armed:
                self.later += 1
                log.warning("kernel specialization first met after the warm-up (compiled or loaded inside a "
                            "step): %s", str(kw.get("repr"))[:600])
            return
        if self.armed:
            self.later += 1
            near = v.nearest(self.seen)
            what = "; ".join(v.differences(near)) if near is not None else "a kernel not met before"
            log.warning("kernel specialization first met after the warm-up (compiled or loaded inside a step): "
                        "%s [%s], differs from the nearest met before in: %s", v.kernel, v.options, what)
        self.seen.append(v)


def watch_compiles() -> CompileWatch | None:
    """The process's CompileWatch, installed as Triton's `jit_cache_hook` on first call (chaining the hook already
    set, which still sees every call); None where this Triton has no such hook."""
    try:
        import triton
    except ImportError:
        return None
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_cache_hook"):
        return None
    current = runtime.jit_cache_hook
    watch = getattr(current, "compile_watch", None)
    if watch is not None:
        return watch
    watch = CompileWatch()

    def hook(**kw) -> bool:
        watch(kw)
        # A true value would skip the compile: only the hook set before ours decides that.
        return bool(current(**kw)) if current is not None else False

    hook.compile_watch = watch
    runtime.jit_cache_hook = hook
    return watch
