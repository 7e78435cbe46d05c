"""The module-scoped ``cluster`` fixture the chaos modules share: one ``kvserve serve`` per module, started
with that module's flags and stopped after its last test (also when a test failed)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.chaos.conftest import ServedCluster, serve_cluster, stop_cluster


def cluster_fixture(*extra_args: str, **kwargs: Any) -> Callable[..., Iterator[ServedCluster]]:
    """A fixture named ``cluster``: ``serve_cluster(tiny_llama_dir, *extra_args, **kwargs)`` for the module.

    Use: ``cluster = cluster_fixture("--worker-restart-limit", "0")`` at a test module's top level.
    """

    @pytest.fixture(scope="module", name="cluster")
    def _cluster(tiny_llama_dir: Path) -> Iterator[ServedCluster]:
        c = serve_cluster(tiny_llama_dir, *extra_args, **kwargs)
        try:
            yield c
        finally:
            stop_cluster(c)

    return _cluster
