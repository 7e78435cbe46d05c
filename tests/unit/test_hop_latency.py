"""`kvserve bench hop-latency`: every transport delivers every stamped message, one hop each."""

from __future__ import annotations

import json
import sys

import pytest

from kvserve.cluster.bench import hop_latency
from kvserve.cluster.cli import main

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="pipes passed to a child by fd")


@pytest.mark.parametrize("transport", hop_latency.TRANSPORTS)
def test_each_transport_delivers_every_message_with_a_latency(transport: str) -> None:
    got = hop_latency.measure(transport, count=20, gap_ms=2.0)
    assert got["samples"] == 20
    # a hop takes some time and far less than a second; the percentiles are ordered
    assert 0.0 < got["p50_ms"] <= got["p90_ms"] <= got["p99_ms"] <= got["max_ms"] < 1000.0


def test_percentiles_are_nearest_rank() -> None:
    got = hop_latency.percentiles([float(i) for i in range(1, 101)])
    assert (got["p50_ms"], got["p90_ms"], got["p99_ms"], got["max_ms"]) == (51.0, 91.0, 100.0, 100.0)
    with pytest.raises(ValueError):
        hop_latency.percentiles([])


def test_cli_json_and_usage(capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "hop-latency", "--transports", "pipe,tcp", "--count", "5", "--gap-ms", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["transports"]) == {"pipe", "tcp"} and report["count"] == 5
    assert main(["bench", "hop-latency", "--transports", "carrier-pigeon"]) == 2
    assert "carrier-pigeon" in capsys.readouterr().err
