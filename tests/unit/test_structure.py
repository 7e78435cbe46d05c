"""Guards of the layout docs/architecture.md draws: no file-level import cycle anywhere in kvserve, the
router's pipeline class stays small, kvserve's packages cannot be shadowed by a dependency's
top-level package (Hugging Face's ``kernels`` did that once), and no test hook (``*_for_test``) lives in
production code."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kvserve"
ROUTER_MAX_LINES = 350


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _file_level_imports(path: Path, known: set[str]) -> set[str]:
    """kvserve modules ``path`` imports outside any function (``if TYPE_CHECKING:`` blocks count: a
    type-only cycle is still two files that each need the other)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                continue  # a deferred import is a deliberate, documented break
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                found.add(child.module)
                found.update(f"{child.module}.{a.name}" for a in child.names)
            visit(child)

    visit(ast.parse(path.read_text()))
    return found & known


def import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    known = set(files)
    return {name: _file_level_imports(path, known) - {name} for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_file_level_import_cycle_in_kvserve() -> None:
    graph = import_graph()
    assert "kvserve.router.requests.router" in graph and graph["kvserve.router.requests.router"]
    assert cycles(graph) == [], "file-level import cycles (break one with a contract, as pipeline.py does)"


def test_the_router_pipeline_class_stays_small() -> None:
    lines = len((PACKAGE / "router" / "requests" / "router.py").read_text().splitlines())
    assert lines <= ROUTER_MAX_LINES, (
        f"kvserve/router/requests/router.py has {lines} lines (limit {ROUTER_MAX_LINES}): move a concern out "
        "(lifecycle.py, columns.py, dispatch.py show how)"
    )


def test_a_top_level_package_named_like_ours_does_not_shadow_kvserve(tmp_path: Path) -> None:
    """A dependency may install a top-level ``kernels`` (Hugging Face's does) or ``router``: kvserve's
    own parts import from ``kvserve.`` and both sit side by side."""
    for name in ("kernels", "router", "workers", "protos"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"FOREIGN = {name!r}\n")
    code = (
        "import kernels, router, workers, protos\n"
        "assert (kernels.FOREIGN, router.FOREIGN, workers.FOREIGN, protos.FOREIGN) == "
        "('kernels', 'router', 'workers', 'protos')\n"
        "from kvserve.kernels import get_backend\n"
        "from kvserve.router.requests.router import Router\n"
        "from kvserve.workers.engine.engine import LLMEngine\n"
        "assert get_backend('cpu') is not None and Router and LLMEngine\n"
        "import sys\n"
        "assert not any(m.startswith('kvserve') for m in (kernels.__name__, router.__name__))\n"
        "print('ok')\n"
    )
    # NOTE: the foreign packages come first on the path, as a site-packages install of one would
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                         cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_no_test_hook_in_kvserve() -> None:
    """Production code carries no test-only entry point: a fault a test needs is injected from
    ``tests/`` (a subclass of the actor there, e.g. ``tests/chaos/fault_router.py``,
    ``tests/integration/fault_worker.py``) through a seam that also serves production."""
    hooks = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.endswith("_for_test")
    ]
    assert hooks == [], f"test hooks in production code (move them into tests/): {hooks}"
