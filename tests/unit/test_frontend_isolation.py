"""A frontend holds no router state, indirect imports included (issue 40): nothing ``kvserve.frontend``
imports, through any chain of file-level imports (``TYPE_CHECKING`` ones too), is a module the
``frontend holds no router state`` contract of ``pyproject.toml`` forbids. The code it shares with the
router sees the router through small protocols (``gate/bounds.py`` ``Admitting``, ``api/readiness.py``
``ReadinessSource``, ``gate/prompt_preparer.py`` ``PromptModel``, ``api/http_api.py`` ``ApiBackend``);
naming the ``Router`` class in any of them would pull in the request table.

``make lint`` checks the same contract with import-linter; this test holds it in the test suite too,
and holds the contract itself to checking indirect imports."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import tomllib

from tests.unit.test_structure import ROOT, import_graph

CONTRACT = "frontend holds no router state"


def _contract() -> dict:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return next(c for c in config["contracts"] if c["name"] == CONTRACT)


def forbidden_chains(
    graph: Mapping[str, set[str]], sources: Iterable[str], forbidden: Iterable[str], ignored: set[tuple[str, str]]
) -> dict[str, list[str]]:
    """Each forbidden module reachable from a module under ``sources``, with one import chain to it
    (breadth-first, so the shortest); ``ignored`` edges are not followed."""
    forbidden = tuple(forbidden)

    def is_forbidden(m: str) -> bool:
        return any(m == f or m.startswith(f + ".") for f in forbidden)

    starts = [m for m in graph if any(m == s or m.startswith(s + ".") for s in sources)]
    parent: dict[str, str | None] = dict.fromkeys(starts)
    queue = list(starts)
    found: dict[str, list[str]] = {}
    while queue:
        m = queue.pop(0)
        if is_forbidden(m):
            chain = [m]
            while (p := parent[chain[-1]]) is not None:
                chain.append(p)
            found[m] = chain[::-1]
            continue  # NOTE: what it imports in turn is reported from the first forbidden module only
        for n in sorted(graph.get(m, ())):
            if n not in parent and (m, n) not in ignored:
                parent[n] = m
                queue.append(n)
    return found


def test_the_check_follows_indirect_and_type_only_imports() -> None:
    graph = {"f.a": {"r.gate"}, "r.gate": {"r.config", "r.router"}, "r.router": set(), "r.config": {"r.policy"}}
    found = forbidden_chains(graph, ["f"], ["r.router", "r.policy"], {("r.config", "r.policy")})
    assert found == {"r.router": ["f.a", "r.gate", "r.router"]}


def test_the_frontend_contract_checks_indirect_imports() -> None:
    assert not _contract().get("allow_indirect_imports", False), (
        f"pyproject.toml: the {CONTRACT!r} contract must check indirect imports"
    )


def test_no_frontend_module_reaches_router_state() -> None:
    contract = _contract()
    ignored = {tuple(part.strip() for part in rule.split("->")) for rule in contract.get("ignore_imports", ())}
    found = forbidden_chains(import_graph(), contract["source_modules"], contract["forbidden_modules"], ignored)  # type: ignore[arg-type]
    assert not found, "the frontend reaches router state: " + "; ".join(" -> ".join(c) for c in found.values())
