"""The house's floors, checked from the source (every import, also those inside functions and
the modules a package's lazy exports name):

    tandem/      the `tandem` command: wires everything below
    server/      the OpenAI-compatible HTTP server
    workers/     Celery workers, the job store, camera ingestion
    runtime/     engines, runners, the device memory manager
    sources/     images, videos, streams
    kernels/  schedulers/   the ground floor: they import nothing of the project

Each package imports only packages on floors below its own. benchmarks/ stands beside the
house: it may import any floor, and no floor imports it. No two modules import each other,
directly or round a circle. schedulers/ never imports torch (nor numpy): it is policy only.
runtime/ never imports prometheus_client or redis: the server renders, the workers publish.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLOORS = {"kernels": 0, "schedulers": 0, "sources": 1, "runtime": 2, "workers": 3, "server": 4, "tandem": 5}
BESIDE = "benchmarks"
PACKAGES = (*FLOORS, BESIDE)


def _rel(path: Path) -> Path:
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


MODULES = _modules()


def _imports(path: Path, lazy: bool = True) -> list[tuple[int, str]]:
    """(line, imported name) for every absolute import in the file, at any depth; with `lazy`,
    also the modules a package's lazy exports import on first use."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            raise AssertionError(f"{path}:{node.lineno}: use absolute imports (the floors are read from them)")
        elif (
            lazy
            and isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets)
        ):
            # A package's lazy exports (runtime/lazy.py): each value names a module imported on
            # first use, an import like any other.
            found += [(v.lineno, v.value) for v in getattr(node.value, "values", []) if isinstance(v, ast.Constant)]
    return found


def _resolve(name: str) -> str | None:
    """The project module an imported name refers to (the longest known prefix), or None."""
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        candidate = ".".join(parts[:k])
        if candidate in MODULES:
            return candidate
    return None


def _edges() -> dict[str, set[str]]:
    """Who imports whom when a module is imported (lazy exports load later: they close no circle)."""
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for mod, path in MODULES.items():
        for _, name in _imports(path, lazy=False):
            target = _resolve(name)
            if target is not None and target != mod:
                edges[mod].add(target)
    return edges


def _package(mod: str) -> str:
    return mod.split(".")[0]


def test_every_package_imports_only_floors_below_its_own():
    wrong = []
    for mod, path in MODULES.items():
        pkg = _package(mod)
        for line, name in _imports(path):
            target = _resolve(name)
            if target is None or _package(target) == pkg:
                continue
            other = _package(target)
            if pkg == BESIDE:
                continue  # the benchmarks may measure any floor
            if other == BESIDE:
                wrong.append(f"{_rel(path)}:{line} imports {target}: nothing of the product imports the benchmarks")
            elif FLOORS[other] >= FLOORS[pkg]:
                wrong.append(
                    f"{_rel(path)}:{line} imports {target}, on floor {FLOORS[other]}, from floor {FLOORS[pkg]}"
                )
    assert not wrong, "\n".join(dict.fromkeys(wrong))


def test_there_are_no_import_circles():
    edges = _edges()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert not circles, f"modules that import each other: {circles}"


# Libraries a package keeps out of every import: schedulers/ is policy only (no torch, no
# numpy); runtime/ keeps its counters in process, and leaves Prometheus text to server/ and Redis
# to workers/, so an engine never waits on a scrape or a network round trip.
BANNED = {"schedulers": ("torch", "numpy", "triton"), "runtime": ("prometheus_client", "redis")}


def _banned_imports(package: str, paths: list[Path] | None = None) -> list[str]:
    paths = sorted((ROOT / package).rglob("*.py")) if paths is None else paths
    found = [
        f"{_rel(p)}:{line} imports {name.split('.')[0]}"
        for p in paths
        for line, name in _imports(p)
        if name.split(".")[0] in BANNED[package]
    ]
    return list(dict.fromkeys(found))


@pytest.mark.parametrize("package", sorted(BANNED))
def test_a_package_imports_none_of_its_banned_libraries(package):
    found = _banned_imports(package)
    assert not found, "\n".join(found)


def test_the_library_check_sees_redis_and_prometheus_in_runtime(tmp_path):
    """The check can fail on both halves, also for an import inside a function (runtime/ never
    imported redis itself: it was handed a client, which this check cannot see)."""
    fake = tmp_path / "_banned_probe.py"
    fake.write_text(
        "import json\n\n\ndef f():\n    from redis.exceptions import RedisError\n    import prometheus_client\n"
    )
    assert _banned_imports("runtime", [fake]) == [f"{fake}:5 imports redis", f"{fake}:6 imports prometheus_client"]


def test_the_floor_check_sees_a_wrong_import(tmp_path):
    """The check itself can fail: an upward import in a file it reads is named, also one that
    hides in a package's lazy exports. (The probe lives in tmp_path, read as a runtime module.)"""
    fake = tmp_path / "_layers_probe.py"
    fake.write_text("_LAZY = {'X': 'workers.settings'}\n\ndef f():\n    from workers.host import host_stats\n")
    MODULES["runtime._layers_probe"] = fake
    try:
        with pytest.raises(AssertionError) as info:
            test_every_package_imports_only_floors_below_its_own()
    finally:
        MODULES.pop("runtime._layers_probe", None)
    assert f"{fake}:1 imports workers.settings, on floor 3, from floor 2" in str(info.value)
    assert f"{fake}:4 imports workers.host, on floor 3, from floor 2" in str(info.value)
