"""`kvserve bench call-cost`: both channels measured for real (a local Ray, a gRPC peer process)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_both_channels_report_the_senders_cpu_per_message() -> None:
    cmd = [sys.executable, "-m", "kvserve.cluster.cli", "bench", "call-cost", "--count", "30", "--runs", "1", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result["channels"]) == {"ray", "grpc"}
    for channel in result["channels"].values():
        assert channel["us_per_message"] > 0 and len(channel["runs"]) == 1


def test_an_unknown_channel_is_a_usage_error() -> None:
    cmd = [sys.executable, "-m", "kvserve.cluster.cli", "bench", "call-cost", "--channels", "pigeon"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "channels must be among" in out.stderr
