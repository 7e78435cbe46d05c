"""The chaos tests' router actor: the production ``RouterActor`` plus ``arm_migration_fault``, which kills
or stops one side of the next live migration at a phase boundary (tests/chaos/test_migration_faults.py).

It lives here, not in ``kvserve/``, so no production actor carries a test-only method
(tests/unit/test_structure.py). It reaches the move through ``Mover.fault``, the router's own seam at
each phase boundary (kvserve/router/requests/migrations.py; the unit tests use it directly). A cluster
runs it when started through ``start_cluster(router_actor=FaultRouter)``: ``serve_cluster(...,
fault_router=True)`` in tests/chaos/conftest.py starts ``kvserve serve`` that way (tests/chaos/fault_serve.py),
and tests/chaos/ray_probe.py calls it through Ray, so no gRPC or HTTP route leads to it.
"""

from __future__ import annotations

import logging
import os
import signal

from kvserve.router.api.server import RouterActor
from kvserve.router.policy.rebalance import Migration
from kvserve.router.requests.request import RouterRequest

logger = logging.getLogger(__name__)

PHASES = ("before_export", "before_import", "after_import")  # Mover.fault's phase boundaries
ACTIONS = {"kill": signal.SIGKILL, "hang": signal.SIGSTOP}
SIDES = ("src", "dst", "router")  # "router": the router's own process (killed mid-migration)


class FaultRouter(RouterActor):
    """``RouterActor`` with ``arm_migration_fault``; everything else is the production actor's."""

    async def arm_migration_fault(self, phase: str, action: str, side: str) -> None:
        """At the next migration's ``phase`` boundary (``Mover.fault``: "before_export",
        "before_import", "after_import"), SIGKILL ("kill") or SIGSTOP ("hang") the process of that
        move's ``side`` ("src" or "dst") worker, or the router's own ("router"), then let the move go on. Once:
        the fault disarms itself.

        Raises:
            ValueError: an unknown phase, action or side.
        """
        if phase not in PHASES or action not in ACTIONS or side not in SIDES:
            raise ValueError(f"bad fault {phase!r}/{action!r}/{side!r}")
        mover = self.router.mover

        async def fault(at: str, r: RouterRequest, move: Migration) -> None:
            if at != phase:
                return
            mover.fault = None  # once
            if side == "router":
                logger.warning("test fault: %s of the router itself at %s of %s", action, phase, r.request_id)
                os.kill(os.getpid(), ACTIONS[action])
                return
            worker_id = move.src if side == "src" else move.dst
            pid = int(await self.router.table[worker_id].handle.pid.remote())
            os.kill(pid, ACTIONS[action])
            logger.warning("test fault: %s of %s worker %s (pid %d) at %s of %s", action, side, worker_id, pid,
                           phase, r.request_id)  # fmt: skip

        mover.fault = fault

    async def owned_keys(self) -> list[str]:
        """The router's ids of the requests frontends own (their owner keys; kvserve/router/requests/owned.py)."""
        return sorted(self.router.owned.by_key)
