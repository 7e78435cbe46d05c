"""Python's garbage collector in long-running kvserve processes (router, frontends, workers): the
start-up heap frozen out of its scans, and the pauses it still takes, measured.

NOTE: a full (generation 2) collection walks every tracked object in the process. After importing
Ray, gRPC and torch a router or worker holds ~240k of them, and one full collection took ~140 ms on
a Zen 3 core: on the router's event loop that is a 140 ms gap in every stream; in a worker's step
loop, a step 140 ms late for every request it runs. Full collections come when the objects promoted
since the last one exceed a quarter of those that survived it, so a busy server meets them again and
again (per-request state lives seconds, long enough to be promoted). ``freeze_heap`` moves what
exists once start-up is done (modules, the model's Python objects, Ray's and gRPC's state) to the
permanent generation that no collection walks, as vLLM's engine core and SGLang's scheduler do; the
collector keeps running for everything made afterwards. ``KVSERVE_GC_FREEZE=0`` turns it off.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable

from kvserve.workers.core.env_switches import env_switch

logger = logging.getLogger(__name__)

FREEZE_ENV = "KVSERVE_GC_FREEZE"
SLOW_PAUSE_S = 0.05  # a collection longer than this is logged: it is a visible gap in every stream


def freeze_heap(process: str) -> int:
    """Collect once, then exempt every surviving object from later collections. Call it when the
    process has finished starting (its long-lived objects exist) and before it serves. Returns the
    number of frozen objects (0 when disabled)."""
    if not env_switch(FREEZE_ENV):
        logger.info("%s: garbage-collector freeze disabled by %s=0", process, FREEZE_ENV)
        return 0
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info(
        "%s: froze %d start-up objects out of garbage collection (%.0f ms)",
        process, frozen, 1e3 * (time.perf_counter() - start),
    )  # fmt: skip
    return frozen


class GcPauses:
    """Times every collection of this process (``gc.callbacks``) and hands each to ``observe(generation,
    seconds)``; logs the ones longer than ``SLOW_PAUSE_S``. ``close()`` unhooks it.

    Contract: ``observe`` runs inside the collector, on whichever thread triggered it; it must be
    cheap and must not allocate much (a Prometheus histogram's ``observe`` qualifies)."""

    def __init__(self, process: str, observe: Callable[[int, float], None] | None = None) -> None:
        self.process = process
        self._observe = observe
        self._started: float | None = None
        self.collections = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.longest_s = 0.0
        gc.callbacks.append(self._on_gc)

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:
            return
        seconds = time.perf_counter() - self._started
        self._started = None
        generation = int(info.get("generation", 2))
        self.collections[generation] += 1
        self.seconds[generation] += seconds
        self.longest_s = max(self.longest_s, seconds)
        if self._observe is not None:
            self._observe(generation, seconds)
        if seconds > SLOW_PAUSE_S:
            logger.warning(
                "%s: a generation-%d garbage collection paused the process for %.0f ms (%d objects collected)",
                self.process, generation, 1e3 * seconds, info.get("collected", 0),
            )  # fmt: skip


def settle_heap(process: str, observe: Callable[[int, float], None] | None = None) -> tuple[int, GcPauses]:
    """What a long-lived process does once started: ``freeze_heap``, then time what is collected from
    then on (after it, so the freeze's own collection is not reported as a pause). Returns the number
    of frozen objects and the ``GcPauses``."""
    frozen = freeze_heap(process)
    return frozen, GcPauses(process, observe)
