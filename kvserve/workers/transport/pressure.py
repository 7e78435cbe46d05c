"""A worker's block-pressure report: what it says (``pressure_report``: the engine's own stats plus what
the worker measures) and when it is sent (``PressurePolicy``: the rate policy, apart from the mechanism)."""

from __future__ import annotations

import copyreg
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.workers.core.sizes import pool_usage
from kvserve.workers.engine.stats import EngineStats

if TYPE_CHECKING:
    from kvserve.workers.transport.options import WorkerOptions


def report_from_bytes(data: bytes) -> pb.PressureReport:
    return pb.PressureReport.FromString(data)


# NOTE: generated messages name their module by the proto package (kvserve.v1.worker_pb2), which is not
# importable as such, so pickle (Ray's return values: ``Worker.stats``) cannot find the class by name.
copyreg.pickle(pb.PressureReport, lambda m: (report_from_bytes, (m.SerializeToString(),)))


# The report's fields the worker fills itself; every other field is an ``EngineStats`` field of that name.
WORKER_FIELDS = frozenset({"worker_id", "seq", "decode_steps", "step_latency_ms", "num_imports_total",
                           "num_exports_total"})  # fmt: skip


def pressure_report(
    worker_id: str,
    stats: EngineStats,
    *,
    decode_steps: int,
    step_latency_ms: float,
    num_imports_total: int,
    num_exports_total: int,
) -> pb.PressureReport:
    """The report of ``worker_id`` (``seq`` unset: stamped when sent): every ``EngineStats`` field by name,
    and what the worker measures around the engine (steps that sampled, the last step's latency, the
    migrations it carried out)."""
    return pb.PressureReport(
        worker_id=worker_id,
        decode_steps=decode_steps,
        step_latency_ms=step_latency_ms,
        num_imports_total=num_imports_total,
        num_exports_total=num_exports_total,
        **vars(stats),
    )


def report_usage(report: pb.PressureReport) -> float:
    return pool_usage(report.used_blocks, report.total_blocks)


def _counts(r: pb.PressureReport) -> tuple[int, ...]:
    """What a report carries that placement reads: a change of these is worth a report."""
    return (r.free_blocks, r.used_blocks, r.cached_evictable_blocks, r.swap_blocks_free, r.num_running,
            r.num_waiting, r.num_swapped)  # fmt: skip


@dataclass
class PressurePolicy:
    """Report after a step that changed block counts, at most every ``interval_s``; at least every
    ``idle_interval_s`` (liveness); at once when usage crosses the high or low watermark, since
    that is what admission and migration decisions hinge on.
    """

    interval_s: float = 0.05
    idle_interval_s: float = 1.0
    high_watermark: float = 0.9
    low_watermark: float = 0.7
    _last_time: float = float("-inf")
    _last_counts: tuple[int, ...] = ()
    _last_usage: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.low_watermark <= self.high_watermark <= 1.0:
            raise ValueError(
                f"need 0 <= low_watermark <= high_watermark <= 1, got {self.low_watermark}, {self.high_watermark}"
            )
        if self.interval_s < 0 or self.idle_interval_s <= 0:
            raise ValueError("pressure intervals must be positive")

    @classmethod
    def from_options(cls, o: WorkerOptions) -> PressurePolicy:
        """The policy a worker with options ``o`` reports by (the real worker and the bench's simulated one)."""
        return cls(o.pressure_interval_ms / 1000, o.idle_report_s, o.high_watermark, o.low_watermark)

    def crossed(self, usage: float) -> bool:
        before, now = self._last_usage, usage
        return (before >= self.high_watermark) != (now >= self.high_watermark) or (before <= self.low_watermark) != (
            now <= self.low_watermark
        )

    def due(self, now: float, report: pb.PressureReport) -> bool:
        """Should ``report`` go out now?"""
        elapsed = now - self._last_time
        if self.crossed(report_usage(report)):
            return True
        if _counts(report) != self._last_counts and elapsed >= self.interval_s:
            return True
        return elapsed >= self.idle_interval_s

    def wait_s(self, now: float, report: pb.PressureReport) -> float:
        """Seconds until ``due`` turns true for ``report`` if nothing else changes (0: due now)."""
        if self.due(now, report):
            return 0.0
        elapsed = now - self._last_time
        if _counts(report) != self._last_counts:
            return max(0.0, self.interval_s - elapsed)
        return max(0.0, self.idle_interval_s - elapsed)

    def reset(self) -> None:
        """Forget the last report: the next ``due`` is true (a new router connection knows nothing yet)."""
        self._last_time = float("-inf")

    def sent(self, now: float, report: pb.PressureReport) -> None:
        self._last_time, self._last_usage, self._last_counts = now, report_usage(report), _counts(report)
