"""`kvserve bench served`: a real cluster with a frontend, served and offline passes of the tiny workload, the tokens
identical and every role's CPU per streamed token measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_served_vs_offline_reports_identical_tokens_and_cpu_by_role(tiny_llama_dir: Path) -> None:
    cmd = [sys.executable, "-m", "kvserve.cluster.cli", "bench", "served", "--model", str(tiny_llama_dir),
           "--workload", "tiny", "--rounds", "1", "--workers", "1", "--frontends", "1", "--cpus-per-worker", "1",
           "--json"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["identical_tokens"] is True, "served tokens differ from the offline engine's (greedy)"
    assert summary["streamed_tokens_per_pass"] == 64 * 64
    assert summary["served_median"] > 0 and summary["offline_median"] > 0
    for role in ("router", "frontends", "client"):
        assert summary[f"{role}_cpu_us_per_token_median"] > 0, role
    assert summary["router_thread_cpu_s"] and summary["cpu_model"]
