"""``kvserve bench compare-serve --targets kvserve`` end to end on a tiny random model: a real ``kvserve serve``
(its own Ray), waited for, driven over HTTP, stopped with everything it started.

The client is vLLM's ``vllm bench serve`` when ``$KVSERVE_PEER_PYTHON`` names a vLLM venv
(``kvserve/cluster/bench/setup_peers.sh vllm``); otherwise a stand-in ``vllm`` executable whose ``bench serve``
sends the same number of real streamed greedy completions to the server and writes the figures it
measured in vLLM's result format, so the harness's launch, readiness, model-name check, parsing and
cleanup are exercised without vLLM. Short: 4 requests of 8 tokens.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from kvserve.cluster.cli import main

# `vllm bench serve` stand-in: streamed /v1/completions, TTFT / ITL measured, vLLM's result keys.
STAND_IN = textwrap.dedent(
    """
    import json, os, statistics, sys, time, urllib.request
    argv = sys.argv[1:]
    assert argv[:2] == ["bench", "serve"], argv
    opt = lambda name: argv[argv.index(name) + 1]
    n, out_len = int(opt("--num-prompts")), int(opt("--random-output-len"))
    ttft, itl, tokens, t0 = [], [], 0, time.perf_counter()
    for i in range(n):
        body = {"model": opt("--model"), "prompt": f"request {i}: hello", "max_tokens": out_len, "temperature": 0,
                "ignore_eos": True, "stream": True}
        req = urllib.request.Request(opt("--base-url") + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        last, first = time.perf_counter(), True
        with urllib.request.urlopen(req, timeout=120) as r:
            for line in r:
                if not line.startswith(b"data: {"):
                    continue  # blank separators and "data: [DONE]"
                now = time.perf_counter()
                (ttft if first else itl).append(now - last)
                last, first = now, False
                tokens += 1
    ms = lambda xs: 1e3 * statistics.median(xs)
    res = {"completed": n, "failed": 0, "output_throughput": tokens / (time.perf_counter() - t0),
           "median_ttft_ms": ms(ttft), "p90_ttft_ms": 1e3 * max(ttft), "median_tpot_ms": ms(itl),
           "median_itl_ms": ms(itl)}
    open(os.path.join(opt("--result-dir"), opt("--result-filename")), "w").write(json.dumps(res))
    """
)


def _peer_python(tmp_path: Path) -> str:
    real = os.environ.get("KVSERVE_PEER_PYTHON")
    if real and (Path(real).parent / "vllm").exists():
        return real
    bin_dir = tmp_path / "peers" / "vllm" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "vllm").write_text(f"#!{sys.executable}\n{STAND_IN}")
    (bin_dir / "vllm").chmod(0o755)
    (bin_dir / "python").symlink_to(sys.executable)
    return str(bin_dir / "python")


@pytest.mark.slow
def test_compare_serve_kvserve_only(tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    status = main(["bench", "compare-serve", "--peer-python", _peer_python(tmp_path), "--model", str(tiny_llama_dir),
                   "--targets", "kvserve", "--runs", "1", "--num-prompts", "4", "--max-concurrency", "2",
                   "--input-len", "16", "--output-len", "8", "--workers", "1", "--guidellm-bin", "none", "--json",
                   "--log-dir", str(tmp_path / "logs"), "--ready-timeout", "300"])  # fmt: skip
    out = capsys.readouterr()
    assert status == 0, out.err
    kv = json.loads(out.out)["clients"]["vllm bench serve"]["kvserve"]
    assert kv["rounds"][0]["completed"] == 4 and kv["failed"] == 0
    assert kv["median"]["output_tokens_per_s"] > 0 and kv["median"]["ttft_p50_ms"] > 0
    log = (tmp_path / "logs" / "round-1" / "kvserve" / "kvserve.log").read_text()
    assert "OpenAI-compatible HTTP API on" in log and "stopped" in log  # it was shut down cleanly (SIGTERM)
    left = {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert not left, f"compare-serve left processes behind: {left}"
