"""``kvserve generate --server`` and ``kvserve status --server`` as subprocesses against a live
cluster (real Ray, gRPC on 127.0.0.1, bearer-token auth on, so the token flags are exercised)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.router.config import RouterConfig
from kvserve.workers.engine.config import EngineConfig

REPO = Path(__file__).resolve().parents[2]
TOKEN = "cli-test-token"
MAX_TOKENS = "12"


@pytest.fixture(scope="module")
def cluster(ray_session, tiny_llama_dir):
    from kvserve.cluster.launch import start_cluster

    cl = start_cluster(
        EngineConfig(str(tiny_llama_dir), num_gpu_blocks=64),
        2,
        RouterConfig(port=0, model=str(tiny_llama_dir), auth_token=TOKEN),
        ready_timeout_s=120,
    )
    yield cl
    cl.shutdown()


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.json"
    path.write_text(json.dumps([[1, 2, 3, 4, 5], [300 + i for i in range(40)], [7] * 17, [31999, 3]]))
    return path


def kvserve(*args: str, token: str | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "KVSERVE_AUTH_TOKEN"}
    # NOTE: one torch thread: on a small loaded machine more threads only spin against the workers.
    env.update(OMP_NUM_THREADS="1", COLUMNS="200")
    if token is not None:
        env["KVSERVE_AUTH_TOKEN"] = token
    return subprocess.run(
        [sys.executable, "-m", "kvserve.cluster.cli", *args], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def sampling_args(prompts_file: Path) -> list[str]:
    return [
        "--prompt", "Hello remote world", "--prompt-token-ids", str(prompts_file),
        "--max-tokens", MAX_TOKENS, "--ignore-eos",
    ]  # fmt: skip


def test_remote_generate_json_equals_offline(cluster, tiny_llama_dir, prompts_file):
    offline = kvserve(
        "generate", "--model", str(tiny_llama_dir), "--num-gpu-blocks", "256", "--json", *sampling_args(prompts_file)
    )
    assert offline.returncode == 0, offline.stderr
    remote = kvserve(
        "generate", "--server", cluster.address, "--auth-token", TOKEN, "--json", *sampling_args(prompts_file)
    )
    assert remote.returncode == 0, remote.stderr
    assert remote.stdout == offline.stdout
    outputs = json.loads(remote.stdout)
    assert len(outputs) == 5 and all(len(ids) == int(MAX_TOKENS) for ids in outputs)


def test_remote_generate_text_output_and_token_from_env(cluster, prompts_file):
    out = kvserve("generate", "--server", cluster.address, *sampling_args(prompts_file), token=TOKEN)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("finish_reason: length") == 5
    assert "prompt: 'Hello remote world'" in out.stdout
    assert "<40 token ids>" in out.stdout


def test_remote_generate_errors_name_the_status(cluster, tmp_path):
    no_token = kvserve("generate", "--server", cluster.address, "--prompt", "hi", "--max-tokens", "2")
    assert no_token.returncode != 0
    assert "UNAUTHENTICATED" in no_token.stderr
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([[1, 2], [99999]]))
    invalid = kvserve("generate", "--server", cluster.address, "--prompt-token-ids", str(bad), token=TOKEN)
    assert invalid.returncode != 0
    assert "INVALID_ARGUMENT" in invalid.stderr and "prompt.token_ids" in invalid.stderr


def test_status_json_parses(cluster):
    out = kvserve("status", "--server", cluster.address, "--json", "--auth-token", TOKEN)
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    workers = {w["worker_id"]: w for w in status["workers"]}
    assert set(workers) == {"worker-0", "worker-1"}
    for w in workers.values():
        assert w["healthy"] is True
        report = w["report"]  # NOTE: the worker's own PressureReport, embedded (issue 40 item 4)
        assert report["total_blocks"] == 64  # 64-bit ints come out as JSON numbers
        assert report["used_blocks"] + report["free_blocks"] + report["cached_evictable_blocks"] == 64
        assert 0.0 <= w["usage"] <= 1.0
    router = status["router"]
    assert router["max_queue_requests"] == RouterConfig().max_queue_requests
    assert router["admission_state"] in ("open", "queueing", "rejecting")
    assert status["timestamp_ms"] > 0


def test_status_table(cluster):
    out = kvserve("status", "--server", cluster.address, token=TOKEN)
    assert out.returncode == 0, out.stderr
    for text in ("worker-0", "worker-1", "/64", "router: admission"):
        assert text in out.stdout


def test_status_errors(cluster):
    denied = kvserve("status", "--server", cluster.address, "--json")
    assert denied.returncode == 1 and "UNAUTHENTICATED" in denied.stderr
    host, port = cluster.address.rsplit(":", 1)
    # A port nobody listens on (the router's port + 1 might be taken; port 1 needs root to bind).
    down = kvserve("status", "--server", f"{host}:1", "--json", "--timeout", "5")
    assert down.returncode == 1 and "UNAVAILABLE" in down.stderr
