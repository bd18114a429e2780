"""Triton's interpreter, patched once a launch: a test-time speed-up, not a change of what runs.

To run a kernel on CPU tensors the interpreter swaps `triton.language`'s functions for NumPy ones
(`interpreter._patch_lang`) at each launch, and undoes that when the launch ends. It also calls `_patch_lang`, and
never undoes it, on every call of a `@triton.jit` helper inside the launch (`InterpretedFunction.__call__`): each
time `inspect.getmembers` of four modules, sorted, to replace functions that the launch has already replaced by
equal ones. In the engine tests that is a quarter to a third of the time (a K = 2 static-layout test: ~94,000
helper calls, 39 of its 134 s under cProfile).

`install()` skips a helper's patch inside a launch when the launch's own patch, or an earlier helper's in the same
launch, covered the helper's language modules (its `triton.language` / `triton.language.core` globals; Triton's
own helpers such as `tl.sum` see the core). It keeps Triton's behaviour everywhere else: the launch's own patch,
helpers called outside a launch, the first helper that sees a module not yet patched. If the interpreter's
internals change shape, it leaves them alone and returns False.
"""

from __future__ import annotations

import inspect


class _State:
    in_launch = False
    patched: frozenset[int] | None = None  # ids of the language modules this launch's patches covered so far


def _language_modules(fn, tl, seen: dict) -> frozenset[int]:
    # As `_patch_lang` picks them: the function's module-level names bound to triton.language or its core. (Keyed
    # by the globals' size too: the interpreter adds its own names, `tl` among them, to a module it rewrites.)
    key = fn, len(fn.__globals__)
    modules = seen.get(key)
    if modules is None:
        modules = seen[key] = frozenset(id(v) for v in fn.__globals__.values()
                                       if inspect.ismodule(v) and (v is tl or v is tl.core))
    return modules


def install() -> bool:
    """Skip the interpreter's repeated patches of `triton.language` inside a launch; True once installed."""
    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter, "_patched_once_a_launch", False):
        return True
    patch_lang = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if None in (patch_lang, scope_type, executor) or "fn" not in inspect.signature(patch_lang).parameters:
        return False
    launch = executor.__call__
    state = _State()
    seen: dict = {}

    def patch_once(fn):
        modules = _language_modules(fn, tl, seen)
        if state.patched is not None and modules <= state.patched:
            return scope_type()  # nothing to undo: the launch's patch already covers these modules
        scope = patch_lang(fn)
        if state.in_launch:  # the launch's own patch, or a helper's that Triton never undoes
            state.patched = modules | (state.patched or frozenset())
        return scope

    def launch_patching_once(self, *args, **kwargs):
        outer = state.in_launch, state.patched
        state.in_launch, state.patched = True, None
        try:
            return launch(self, *args, **kwargs)
        finally:
            state.in_launch, state.patched = outer

    interpreter._patch_lang = patch_once
    executor.__call__ = launch_patching_once
    interpreter._patched_once_a_launch = True
    return True
