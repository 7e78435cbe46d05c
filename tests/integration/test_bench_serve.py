"""``kvserve bench serve --launch`` end to end: 2 CPU workers, every policy, a handful of requests.

Checks the table has every row and a column per policy, and that every policy got the identical
dataset and arrival schedule (same digest, same prompts in the same send order, same tenants).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvserve.cluster.bench.serve_report import ROWS
from tests.integration.test_serve import REPO, clean_env

POLICIES = ("kv_aware", "least_loaded", "round_robin")


def test_bench_serve_launch_three_policies(tiny_llama_dir: Path, tmp_path: Path) -> None:
    out_json = tmp_path / "bench.json"
    argv = [
        sys.executable, "-m", "kvserve.cluster.cli", "bench", "serve", "--launch", "--model", str(tiny_llama_dir),
        "--workers", "2", "--dtype", "float32", "--block-size", "4", "--num-gpu-blocks", "256",
        "--dataset", "shared-prefix", "--gsp-num-groups", "2", "--gsp-prompts-per-group", "3",
        "--gsp-system-prompt-len", "16", "--gsp-question-len", "4", "--gsp-output-len", "3",
        "--request-rate", "50", "--policies", ",".join(POLICIES), "--goodput", "ttft:60000",
        "--json-out", str(out_json),
    ]  # fmt: skip
    proc = subprocess.run(argv, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = proc.stdout
    header = table.splitlines()[0]
    for col in (*POLICIES, "least_loaded/kv_aware", "round_robin/kv_aware"):
        assert f" {col} |" in header, header
    for _, label, _ in ROWS:
        assert f"| {label} |" in table, label

    report = json.loads(out_json.read_text())
    runs = report["runs"]
    assert [r["policy"] for r in runs] == list(POLICIES)
    assert len({r["digest"] for r in runs}) == 1
    sent = [[(rec["tenant"], rec["prompt"]) for rec in records] for records in report["records"]]
    assert sent[0] == sent[1] == sent[2] and len(sent[0]) == 6
    for r in runs:
        assert r["completed"] == 6 and r["failed"] == 0 and r["rejected"] == 0
        assert r["ideal_cached_tokens"] == 2 * 2 * 16  # 2 groups x 2 later requests x 16-token prefix
        assert abs(sum(r["worker_shares"].values()) - 1) < 1e-9
