"""PressurePolicy: when a worker reports block pressure."""

from __future__ import annotations

import pytest

from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.workers.transport.pressure import PressurePolicy


def r(usage: float, free: int) -> pb.PressureReport:
    """A report of a 100-block pool at ``usage`` with ``free`` free blocks (a count placement reads)."""
    return pb.PressureReport(total_blocks=100, used_blocks=round(usage * 100), free_blocks=free)


def test_rate_limit_idle_liveness_and_watermarks() -> None:
    p = PressurePolicy(interval_s=0.05, idle_interval_s=1.0, high_watermark=0.9, low_watermark=0.7)
    assert p.due(0.0, r(0.5, 1))  # never reported
    p.sent(0.0, r(0.5, 1))
    assert not p.due(0.01, r(0.5, 2))  # changed, but inside the interval
    assert p.due(0.06, r(0.5, 2))
    assert not p.due(0.5, r(0.5, 1))  # unchanged: only the idle interval
    assert p.due(1.0, r(0.5, 1))
    assert p.due(0.01, r(0.95, 1))  # crossing the high watermark: at once


def test_reset_makes_the_next_report_due() -> None:
    p = PressurePolicy()
    p.sent(10.0, r(0.5, 1))
    assert not p.due(10.01, r(0.5, 1))
    p.reset()
    assert p.due(10.01, r(0.5, 1))


def test_bad_watermarks_rejected() -> None:
    with pytest.raises(ValueError, match="low_watermark"):
        PressurePolicy(high_watermark=0.5, low_watermark=0.7)


def test_wait_until_a_held_back_change_is_due() -> None:
    """A change inside the rate limit is due when the interval ends, not an idle interval later."""
    p = PressurePolicy(interval_s=0.05, idle_interval_s=1.0, high_watermark=0.9, low_watermark=0.7)
    p.sent(0.0, r(0.5, 1))
    assert p.wait_s(0.01, r(0.5, 2)) == pytest.approx(0.04)  # changed: the rest of the rate interval
    assert p.wait_s(0.01, r(0.5, 1)) == pytest.approx(0.99)  # unchanged: the idle report
    assert p.wait_s(0.06, r(0.5, 2)) == 0.0
