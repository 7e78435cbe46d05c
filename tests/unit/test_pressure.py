"""PressurePolicy: when a worker reports block pressure."""

from __future__ import annotations

import pytest

from workers.transport.pressure import PressurePolicy


def test_rate_limit_idle_liveness_and_watermarks() -> None:
    p = PressurePolicy(interval_s=0.05, idle_interval_s=1.0, high_watermark=0.9, low_watermark=0.7)
    assert p.due(0.0, 0.5, (1,))  # never reported
    p.sent(0.0, 0.5, (1,))
    assert not p.due(0.01, 0.5, (2,))  # changed, but inside the interval
    assert p.due(0.06, 0.5, (2,))
    assert not p.due(0.5, 0.5, (1,))  # unchanged: only the idle interval
    assert p.due(1.0, 0.5, (1,))
    assert p.due(0.01, 0.95, (1,))  # crossing the high watermark: at once


def test_reset_makes_the_next_report_due() -> None:
    p = PressurePolicy()
    p.sent(10.0, 0.5, (1,))
    assert not p.due(10.01, 0.5, (1,))
    p.reset()
    assert p.due(10.01, 0.5, (1,))


def test_bad_watermarks_rejected() -> None:
    with pytest.raises(ValueError, match="low_watermark"):
        PressurePolicy(high_watermark=0.5, low_watermark=0.7)
