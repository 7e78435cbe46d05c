"""What readiness reads of the router (``kvserve/router/api/health.py``): its worker table's serving
verdicts and the event of its first worker's Hello. A contract, not the ``Router`` class, so the
health module (whose service names a frontend shares) depends on no request or worker table;
``kvserve/router/requests/router.py`` ``Router`` implements it."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any, Protocol


class ServingTable(Protocol):
    """The worker table as readiness sees it (``kvserve/router/table/workers.py`` ``WorkerTable``)."""

    @property
    def entries(self) -> Mapping[str, Any]:
        """Every registered worker's entry, by worker id."""

    def serving(self, entry: Any) -> bool:
        """Whether that entry's worker takes requests now."""

    def any_serving(self) -> bool:
        """Whether some worker takes requests now."""


class ReadinessSource(Protocol):
    @property
    def table(self) -> ServingTable:
        """The router's workers."""

    def ready_event(self) -> asyncio.Event:
        """Set once the first worker said Hello."""
