"""``RouterMetrics`` is the one writer of the router's metrics (issue 40 item 4): no kvserve module but
``kvserve/router/observe/metrics.py`` itself reaches its metric families or helpers; everything else
goes through ``RouterMetrics``' methods (``start_metrics_server`` serves them; ``CounterDeltas`` is a type)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
METRICS = "kvserve.router.observe.metrics"
PUBLIC = {"RouterMetrics", "start_metrics_server", "CounterDeltas"}


def reaches_past_router_metrics(source: str) -> list[str]:
    """The names of ``kvserve.router.observe.metrics`` that ``source`` uses other than ``PUBLIC`` ones."""
    tree = ast.parse(source)
    aliases = set()  # local names bound to the metrics module itself
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == METRICS:
            found += [a.name for a in node.names if a.name not in PUBLIC]
        elif isinstance(node, ast.ImportFrom) and node.module == METRICS.rpartition(".")[0]:
            aliases |= {a.asname or a.name for a in node.names if a.name == "metrics"}
        elif isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name == METRICS and a.asname}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            found += [node.attr] if node.attr not in PUBLIC else []
    return found


def test_the_check_sees_both_ways_in() -> None:
    assert reaches_past_router_metrics(f"from {METRICS} import REJECTIONS, RouterMetrics") == ["REJECTIONS"]
    assert reaches_past_router_metrics("from kvserve.router.observe import metrics\nmetrics.GC_PAUSE.observe(1)") == [
        "GC_PAUSE"
    ]
    assert reaches_past_router_metrics(f"from {METRICS} import RouterMetrics\nRouterMetrics().rejected('x')") == []


def test_only_router_metrics_writes_the_router_metrics() -> None:
    offenders = {}
    for path in (ROOT / "kvserve").rglob("*.py"):
        if path.relative_to(ROOT).as_posix() == "kvserve/router/observe/metrics.py":
            continue
        names = reaches_past_router_metrics(path.read_text())
        if names:
            offenders[path.relative_to(ROOT).as_posix()] = names
    assert not offenders, f"metric writes outside RouterMetrics: {offenders}"
