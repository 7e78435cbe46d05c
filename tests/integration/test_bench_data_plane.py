"""`kvserve bench data-plane` end to end: the real router and WorkerLinks with simulated workers, real
gRPC and HTTP/SSE clients on 127.0.0.1; every token the workers emit reaches its stream, and the
figures scripts read are there."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from kvserve.cluster.bench.data_plane import AddedLatency, percentile, stamps_latency_ms


def test_stamps_and_percentiles() -> None:
    assert stamps_latency_ms("1000000;3000000;", 5_000_000) == [4.0, 2.0]
    assert stamps_latency_ms("", 1) == []
    assert percentile([5.0, 1.0, 3.0], 0.5) == 3.0 and percentile([5.0, 1.0, 3.0], 0.99) == 5.0


def test_a_streams_first_response_is_kept_out_of_the_itl() -> None:
    lat = AddedLatency()
    lat.add("1000000;", 19_000_000, first=True)  # a first response that paid a data link's dial
    lat.add("2000000;3000000;", 5_000_000, first=False)
    assert lat.first == [18.0] and lat.later == [3.0, 2.0]


@pytest.mark.parametrize(
    ("protocol", "frontends", "streams", "step_ms"),
    # NOTE: 300 mux streams: more than one client may open by default (max_streams_per_client, 256); the
    # bench's client is one client by design and must not be refused (it was, silently, in a table);
    # a slow step keeps them all open at once
    [("grpc", 0, 6, 10), ("http", 0, 6, 10), ("http", 1, 6, 10), ("grpc-mux", 0, 300, 200)],
)
def test_every_emitted_token_is_streamed_and_counted(protocol: str, frontends: int, streams: int, step_ms: int) -> None:
    cmd = [
        sys.executable,
        "-m",
        "kvserve.cluster.cli",
        "bench",
        "data-plane",
        "--workers",
        "2",
        "--streams",
        str(streams),
        "--tokens-per-step",
        "3",
        "--max-tokens",
        "20",
        "--step-ms",
        str(step_ms),
        "--protocol",
        protocol,
        "--json",
        "--frontends",
        str(frontends),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (point,) = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert point["failed_streams"] == 0
    assert point["streamed_tokens"] == streams * 20  # none lost, none duplicated
    assert point["streamed_tokens_per_s"] > 0 and point["router_cpu_us_per_token"] > 0
    assert 0 <= point["added_itl_p50_ms"] <= point["added_itl_p99_ms"]
    assert 0 <= point["added_first_p50_ms"] <= point["added_first_p99_ms"]
    assert point["frontends"] == frontends and (point["frontend_cpu_us_per_token"] > 0) == (frontends > 0)


def test_the_steady_window_is_from_every_stream_started_to_the_first_ended() -> None:
    from kvserve.cluster.bench.data_plane import _Meter
    from kvserve.cluster.bench.proc_cpu import CpuReading

    meter = _Meter(streams=2)
    meter.received(0, 1, final=False)
    assert not meter.steady()  # one of two streams started
    meter.received(0, 1, final=False)
    assert meter.steady()
    meter.samples.append((meter.tokens, CpuReading(1.0, {})))
    meter.received(1, 2000, final=False)
    meter.samples.append((meter.tokens, CpuReading(2.5, {})))
    meter.received(1, 5, final=True)
    assert not meter.steady()  # the first stream ended
    assert meter.tokens == 2007 and meter.steady_us_per_token() == pytest.approx((2.5 - 1.0) / 2000 * 1e6)
    assert math.isnan(_Meter(streams=1).steady_us_per_token())
