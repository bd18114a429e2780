"""The dependency rules of DESIGN.md §5, checked by walking every import of every module (function-local ones too,
which hide a dependency as well as a top-level one does): the engine imports no serving library and no serving
package; the router and the SDK never reach torch, directly or through a Baton module; nothing imports `cli`; the
lower layers (engine, transfer, proto, serving) import none of the layers above them."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Top-level folders and the `baton.` packages they install as (pyproject.toml's package-dir).
PACKAGES = ("engine", "transfer", "proto", "serving", "router", "node", "prefill_node", "decode_node", "client", "cli")
SERVING_LIBRARIES = ("grpc", "nixl", "ray", "prometheus_client", "hypercorn")
ABOVE_LOWER_LAYERS = ("router", "node", "prefill_node", "decode_node", "client", "cli")


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["baton", *parts])


@cache
def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if "node_modules" not in path.parts:
                out[_module_name(path)] = path
    return out


@cache
def imports(module: str) -> frozenset[str]:
    """Every module `module` imports, anywhere in its body, as absolute names."""
    path = modules()[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found.add(base)
            # `from baton.x import y` may name a module y.
            found.update(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules())
    return frozenset(found)


def _top(name: str) -> str:
    return name.split(".")[0]


def _layer(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "baton" else None


def reaches(module: str) -> dict[str, list[str]]:
    """Every module reachable from `module` through Baton modules, with one import chain to it."""
    chains = {module: [module]}
    todo = [module]
    while todo:
        m = todo.pop()
        for dep in imports(m):
            if dep in chains:
                continue
            chains[dep] = [*chains[m], dep]
            if dep in modules():
                todo.append(dep)
    return chains


def test_the_walk_sees_the_packages_and_their_imports():
    # A walk that found nothing would pass every rule below.
    assert len(modules()) > 100
    assert "torch" in {_top(d) for d in imports("baton.engine.llm_engine")}
    assert "baton.proto.auth" in reaches("baton.router.server")


@pytest.mark.parametrize("layer", ["engine"])
def test_the_engine_imports_no_serving_library_and_no_serving_package(layer):
    bad = [(m, d) for m in modules() if _layer(m) == layer for d in imports(m)
           if _top(d) in SERVING_LIBRARIES or _layer(d) in (*ABOVE_LOWER_LAYERS, "transfer", "serving")]
    assert bad == []


@pytest.mark.parametrize("layer", ["router", "client"])
def test_the_router_and_the_sdk_never_reach_torch(layer):
    bad = {}
    for m in modules():
        if _layer(m) == layer:
            for dep, chain in reaches(m).items():
                if _top(dep) in ("torch", "triton"):
                    bad[m] = " -> ".join(chain)
    assert bad == {}


def test_nothing_imports_cli():
    bad = [(m, d) for m in modules() if _layer(m) != "cli" for d in imports(m) if _layer(d) == "cli"]
    assert bad == []


@pytest.mark.parametrize("layer", ["engine", "transfer", "proto", "serving"])
def test_lower_layers_import_nothing_above_them(layer):
    bad = [(m, d) for m in modules() if _layer(m) == layer for d in imports(m) if _layer(d) in ABOVE_LOWER_LAYERS]
    assert bad == []


def test_the_router_imports_no_node_package():
    bad = [(m, d) for m in modules() if _layer(m) == "router" for d in imports(m)
           if _layer(d) in ("node", "prefill_node", "decode_node", "transfer")]
    assert bad == []


def test_no_import_cycles_among_batons_modules():
    """Function-local imports included: a cycle hidden in a function is a cycle still (references in `layers/`
    imported by `ops/kernels`, which `layers/` imports, was one)."""
    graph = {m: sorted(d for d in imports(m) if d in modules() and d != m) for m in modules()}
    cycles = []
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in graph[m]:
            # A package's __init__ re-exporting its own modules is not a dependency between layers.
            if d.startswith(m + "."):
                continue
            if state.get(d) == 1:
                cycles.append(" -> ".join([*path[path.index(d):], d]))
            elif d not in state:
                visit(d, [*path, d])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [m])
    assert cycles == []
