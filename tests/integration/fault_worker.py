"""A worker actor that can also be made to stall: ``FaultWorker`` is the production ``Worker`` plus two
fault injections the stall-detection tests (tests/integration/test_worker.py) need. It lives here, not
in ``kvserve/``, so no production actor carries a test-only method (tests/unit/test_structure.py).

Start it as production starts ``Worker``: ``worker_actor_class(actor=FaultWorker)`` (same actor
options). Ray imports this module in the actor's process: the driver's working directory (the repo
root, where pytest runs) is on its workers' path.

Both faults go through the engine thread's inbox, as every command does (kvserve/workers/transport/worker.py's
threading contract), so they land at a step boundary like a real hung kernel or long step would.
"""

from __future__ import annotations

import time
from typing import Any

from kvserve.workers.transport.worker_actor import Worker


class FaultWorker(Worker):
    """``Worker`` with ``stall`` and ``slow_next_step``; everything else is the production actor's."""

    def stall(self, seconds: float) -> None:
        """Block the engine thread for ``seconds`` (as a hung kernel would), from its next turn at the
        inbox; returns at once, without waiting for the stall to begin."""
        self.core._submit(lambda: time.sleep(seconds))

    def slow_next_step(self, seconds: float, computing: bool) -> None:
        """The next engine step first spends ``seconds`` computing (``computing``: a long prefill under
        a noisy neighbour, busy on the CPU) or sleeping (a step waiting on something that never
        comes); the steps after it are the engine's own again. Returns once armed."""
        core = self.core

        def arm() -> None:
            step = core.engine.step

            def slow_step() -> Any:
                core.engine.step = step  # type: ignore[method-assign]  # NOTE: once: the next step is the real one
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    if not computing:
                        time.sleep(max(0.0, end - time.monotonic()))
                return step()

            core.engine.step = slow_step  # type: ignore[method-assign]

        core._call(arm)
