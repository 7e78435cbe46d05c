"""The control side (pool, scheduler, placement, admission, rebalance, configs) imports no heavy module.

Each module is imported in a fresh interpreter, so what another test imported cannot hide a leak.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "grpc", "ray")
CONTROL_MODULES = [
    "kvserve.workers.engine.block_pool",
    "kvserve.workers.engine.scheduler",
    "kvserve.workers.engine.config",
    "kvserve.workers.transport.options",
    "kvserve.router.policy.placement",
    "kvserve.router.policy.admission",
    "kvserve.router.config",
    "kvserve.router.policy.rebalance",  # created by the router redesign; skipped until it exists
    "kvserve.cluster.config",
    "kvserve.cluster.plan",
]


def _heavy_modules_after_import(module: str) -> list[str]:
    code = (
        "import importlib, json, sys\n"
        f"importlib.import_module({module!r})\n"
        f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", CONTROL_MODULES)
def test_control_module_imports_no_heavy_module(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} does not exist yet")
    assert _heavy_modules_after_import(module) == [], f"importing {module} pulls in heavy modules"


def test_the_check_can_fail() -> None:
    """The probe sees a heavy import when there is one (the engine needs torch)."""
    assert "torch" in _heavy_modules_after_import("kvserve.workers.engine.engine")


def test_the_worker_actor_class_imports_no_engine() -> None:
    """Every process handed a worker's actor handle loads the actor's class, with its module: the router does at
    each registration (a restart: seconds of torch imports on its event loop when the class lived beside the
    engine). The engine is imported in the actor's ``__init__``, in the worker's own process."""
    from kvserve.workers.transport.worker_actor import Worker

    assert Worker.__module__ == "kvserve.workers.transport.worker_actor"
    assert _heavy_modules_after_import("kvserve.workers.transport.worker_actor") == []
