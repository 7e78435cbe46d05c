"""``kvserve serve``, ``kvserve top --once`` and ``kvserve demo`` as real subprocesses.

``serve`` starts its own local Ray (not the session's ``ray_session``), so this module needs no Ray
in the test process: everything goes through gRPC and the process table. What it checks: the
printed API/metrics lines, a request streaming tokens (equal to offline greedy), ``top --once``
naming both workers, and SIGINT -> exit 0 within seconds with every process serve started gone.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.protos.kvserve.v1 import serving_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
API_LINE = re.compile(r"API listening on (\S+)")
METRICS_LINE = re.compile(r"metrics listening on (http://\S+)")
HTTP_LINE = re.compile(r"OpenAI-compatible HTTP API on (http://\S+)")


# ---- helpers (also used by test_multinode.py) -----------------------------------------------------
def clean_env(**extra: str) -> dict[str, str]:
    """The environment for a kvserve/ray subprocess: no inherited Ray address or auth token."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "KVSERVE_AUTH_TOKEN")}
    # NOTE: one torch thread per process: on a small loaded machine more only spin against each other.
    env.update(OMP_NUM_THREADS="1", COLUMNS="200", PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0")
    env.update(extra)
    return env


class Proc:
    """A subprocess whose stdout/stderr are read on threads (so it never blocks on a full pipe),
    remembering every descendant seen, so a test can check that none outlives it."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path = REPO) -> None:
        self.argv = argv
        self.popen = subprocess.Popen(
            argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1
        )
        self.ps = psutil.Process(self.popen.pid)
        self.stdout: list[str] = []
        self.stdout_at: list[float] = []  # NOTE: when each stdout line arrived (monotonic): dates an event
        self.stderr: list[str] = []
        self.descendants: dict[int, psutil.Process] = {}
        self._lock = threading.Lock()
        self._readers = [
            threading.Thread(target=self._read, args=(self.popen.stdout, self.stdout), daemon=True),
            threading.Thread(target=self._read, args=(self.popen.stderr, self.stderr), daemon=True),
        ]
        for t in self._readers:
            t.start()

    def _read(self, stream, sink: list[str]) -> None:  # noqa: ANN001
        for line in stream:
            with self._lock:
                sink.append(line)
                if sink is self.stdout:
                    self.stdout_at.append(time.monotonic())

    def note_descendants(self) -> None:
        try:
            for child in self.ps.children(recursive=True):
                self.descendants.setdefault(child.pid, child)
        except psutil.NoSuchProcess:
            pass

    def wait_for_line(self, pattern: re.Pattern, timeout: float) -> re.Match:
        return self.wait_for_dated_line(pattern, timeout)[0]

    def wait_for_dated_line(self, pattern: re.Pattern, timeout: float) -> tuple[re.Match, float]:
        """The first stdout line matching ``pattern`` and when it arrived (monotonic)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.note_descendants()
            with self._lock:
                for line, at in zip(self.stdout, self.stdout_at, strict=True):
                    if m := pattern.search(line):
                        return m, at
            if self.popen.poll() is not None:
                break
            time.sleep(0.2)
        raise AssertionError(
            f"{' '.join(self.argv[:4])}: no line matching {pattern.pattern!r} "
            f"(rc={self.popen.poll()})\nstdout:\n{self.out}\nstderr:\n{self.err[-6000:]}"
        )

    @property
    def out(self) -> str:
        with self._lock:
            return "".join(self.stdout)

    @property
    def err(self) -> str:
        with self._lock:
            return "".join(self.stderr)

    def alive_descendants(self, timeout: float = 10.0) -> list[str]:
        """Descendants seen earlier that are still running after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            alive = []
            for p in self.descendants.values():
                try:
                    if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                        alive.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
                except psutil.NoSuchProcess:
                    pass
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.25)

    def kill_tree(self) -> None:
        """Last resort (a failed test): kill what this process started, by pid."""
        self.note_descendants()
        for p in [self.ps, *self.descendants.values()]:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self.popen.wait(timeout=10)


def kvserve_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvserve.cluster.cli", *args]


def stream_tokens(address: str, ids: list[int], max_tokens: int) -> list[spb.GenerateResponse]:
    with grpc.insecure_channel(address) as channel:
        stub = serving_pb2_grpc.KVServeStub(channel)
        request = spb.GenerateRequest(
            token_ids=spb.TokenIds(ids=ids), sampling=spb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        )
        return list(stub.Generate(request, timeout=120))


SUPERVISION_LINE = re.compile(r"is down:|so that Ray restarts it|WorkerLink broke")


def cluster_status(address: str) -> spb.ClusterStatus:
    with grpc.insecure_channel(address) as channel:
        return serving_pb2_grpc.KVServeStub(channel).GetClusterStatus(spb.ClusterStatusRequest(), timeout=30)


# ---- kvserve serve ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(tiny_llama_dir: Path) -> Iterator[tuple[Proc, str, str]]:
    proc = Proc(
        kvserve_argv(
            "serve", "--model", str(tiny_llama_dir), "--workers", "2", "--port", "0", "--metrics-port", "0",
            "--http-port", "0", "--device", "cpu", "--num-gpu-blocks", "64",
        ),
        clean_env(),
    )  # fmt: skip
    try:
        address = proc.wait_for_line(API_LINE, timeout=180).group(1)
        metrics_url = proc.wait_for_line(METRICS_LINE, timeout=5).group(1)
        proc.wait_for_line(HTTP_LINE, timeout=5)
        proc.note_descendants()
        yield proc, address, metrics_url
    finally:
        if proc.popen.poll() is None:
            proc.kill_tree()


def test_serve_prints_where_it_listens(served: tuple[Proc, str, str]) -> None:
    proc, address, metrics_url = served
    lines = [ln for ln in proc.out.splitlines() if ln.strip()]
    assert len(lines) == 3, f"one line each for the gRPC API, the metrics and the HTTP API, got {lines}"
    assert re.fullmatch(r"127\.0\.0\.1:\d+", address) and not address.endswith(":0")
    assert "worker-0" in lines[0] and "worker-1" in lines[0]
    body = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    assert 'kvserve:worker_up{worker="worker-0"} 1.0' in body and 'kvserve:worker_up{worker="worker-1"} 1.0' in body


def test_http_api_serves_chat(served: tuple[Proc, str, str]) -> None:
    proc, _, _ = served
    base = HTTP_LINE.search(proc.out).group(1)
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/v1", base) and ":0/" not in base
    body = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "ignore_eos": True})
    request = urllib.request.Request(base + "/chat/completions", body.encode(), {"Content-Type": "application/json"})
    out = json.loads(urllib.request.urlopen(request, timeout=60).read())
    assert out["object"] == "chat.completion" and out["usage"]["completion_tokens"] == 3
    assert out["choices"][0]["finish_reason"] == "length"


def test_a_request_streams_tokens(served: tuple[Proc, str, str], tiny_llama_dir: Path) -> None:
    from kvserve.workers.core.sampling_params import SamplingParams
    from kvserve.workers.engine.engine import LLM

    _, address, _ = served
    prompt = [5 + i for i in range(40)]
    responses = stream_tokens(address, prompt, max_tokens=12)
    assert len(responses) >= 2, "tokens arrive as a stream, not in one message"
    tokens = [t for r in responses for t in r.token_ids]
    final = responses[-1]
    assert final.finish_reason == "length" and final.usage.completion_tokens == 12
    assert final.usage.prompt_tokens == len(prompt) and final.worker_id in ("worker-0", "worker-1")
    expected = LLM(str(tiny_llama_dir), num_gpu_blocks=64, device="cpu").generate(
        [prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    )[0]
    assert tokens == list(expected.token_ids), "the cluster generates what the offline engine does"
    status = cluster_status(address)
    assert sorted(w.worker_id for w in status.workers) == ["worker-0", "worker-1"]
    assert all(w.healthy and w.node_id for w in status.workers)


def test_top_once_prints_a_frame(served: tuple[Proc, str, str]) -> None:
    _, address, _ = served
    out = subprocess.run(
        kvserve_argv("top", "--server", address, "--once", "--interval-ms", "200"),
        cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    frame = out.stdout
    print(frame)
    assert f"kvserve top  {address}" in frame and "workers 2/2 healthy" in frame
    for worker_id in ("worker-0", "worker-1"):
        assert re.search(rf"^{worker_id}\s+\S+\s+[█▒░]+\s+\d+\s+\d+\s+\d+\s+\d+%", frame, re.M), frame
    assert "preempt/s" in frame and "router queue 0/" in frame


def test_top_once_reports_an_unreachable_server() -> None:
    out = subprocess.run(
        kvserve_argv("top", "--server", "127.0.0.1:1", "--once"),
        cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 1 and "UNAVAILABLE" in out.stderr


def test_sigint_stops_everything(served: tuple[Proc, str, str]) -> None:
    """Last in this module: it ends the served cluster."""
    proc, address, _ = served
    proc.note_descendants()
    assert len(proc.descendants) >= 4, "serve started Ray (gcs, raylet) and actor processes"
    t0 = time.monotonic()
    proc.popen.send_signal(signal.SIGINT)
    rc = proc.popen.wait(timeout=30)
    took = time.monotonic() - t0
    assert rc == 0, proc.err[-4000:]
    assert took < 15, f"shutdown took {took:.1f}s"
    assert proc.alive_descendants(timeout=10) == [], "no process serve started outlives it"
    with pytest.raises(grpc.RpcError):
        cluster_status(address)
    # An operator's stop is not a failure: the router stops supervising before the workers go, so it neither
    # calls them down nor kills them for a restart on the way out.
    said = proc.out + proc.err
    assert not [line for line in said.splitlines() if SUPERVISION_LINE.search(line)], said[-4000:]


def test_sigterm_stops_everything(tiny_llama_dir: Path) -> None:
    """Kubernetes stops pods with SIGTERM (Ray's own SIGTERM handler must not win: it skips cleanup)."""
    proc = Proc(
        kvserve_argv("serve", "--model", str(tiny_llama_dir), "--workers", "1", "--port", "0", "--metrics-port", "off",
                     "--device", "cpu", "--num-gpu-blocks", "16"),
        clean_env(),
    )  # fmt: skip
    try:
        proc.wait_for_line(API_LINE, timeout=180)
        assert "metrics off" in proc.out
        proc.note_descendants()
        proc.popen.send_signal(signal.SIGTERM)
        assert proc.popen.wait(timeout=30) == 0, proc.err[-4000:]
        assert "SIGTERM: shutting down" in proc.err
        assert proc.alive_descendants(timeout=10) == []
    finally:
        if proc.popen.poll() is None:
            proc.kill_tree()


def test_bad_config_is_a_clear_error(tmp_path: Path) -> None:
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text("model: /nowhere\nengine:\n  block_size: 12\n")
    out = subprocess.run(
        kvserve_argv("serve", "--config", str(cfg)), cwd=REPO, env=clean_env(), capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 2
    assert "engine.block_size: must be a positive power of two, got 12" in out.stderr
    out = subprocess.run(
        kvserve_argv("serve", "--model", str(tmp_path)), cwd=REPO, env=clean_env(), capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 2 and "no config.json" in out.stderr


# ---- kvserve demo -----------------------------------------------------------------------------------
def _demo(argv: list[str], env: dict[str, str], limit_s: float = 240) -> tuple[Proc, int, float]:
    """Run ``kvserve demo ARGV`` to its end: (the process, its exit status, seconds)."""
    t0 = time.monotonic()
    proc = Proc(kvserve_argv("demo", *argv), env)
    try:
        while proc.popen.poll() is None and time.monotonic() - t0 < limit_s:
            proc.note_descendants()
            time.sleep(0.5)
        rc = proc.popen.wait(timeout=1)
    finally:
        if proc.popen.poll() is None:
            proc.kill_tree()
    return proc, rc, time.monotonic() - t0


def _no_registry_env(tmp_path: Path) -> dict[str, str]:
    """A fresh machine without a package registry: empty caches, pip finds no index and no wheel."""
    empty = tmp_path / "no-wheels"
    empty.mkdir(exist_ok=True)
    return clean_env(
        XDG_CACHE_HOME=str(tmp_path), KVSERVE_MODEL_CACHE=str(tmp_path / "models"), PIP_NO_INDEX="1",
        PIP_FIND_LINKS=str(empty),
    )  # fmt: skip


def test_demo_runs_and_summarizes(tmp_path: Path) -> None:
    """A fresh machine without a registry: SmolLM2 cannot be fetched, so one line says so and the demo
    falls back to the tiny random model (XDG_CACHE_HOME is empty) and the random-token workload; no
    live view (not a TTY)."""
    proc, rc, took = _demo(["--requests", "12", "--no-live"], _no_registry_env(tmp_path))
    out = proc.out
    print(out)
    assert rc == 0, proc.err[-4000:]
    assert (tmp_path / "kvserve" / "models" / "tiny-llama" / "config.json").is_file(), "the model is cached"
    fallback = [ln for ln in out.splitlines() if "falling back" in ln]
    assert len(fallback) == 1 and "cannot fetch smollm2-135m-instruct" in fallback[0], out[:2000]
    assert "Traceback" not in proc.err
    summary = out[out.index("kvserve demo summary") :]
    assert "12 ok, 0 failed" in summary
    for field in ("tokens", "tok/s", "prefix cache   hit rate", "preemptions", "swaps", "migrations", "peak KV usage"):
        assert field in summary, field
    hit = float(re.search(r"hit rate ([\d.]+)%", summary).group(1))
    assert hit > 0, "chat requests share a system prompt: some of it comes from the prefix cache"
    assert re.search(r"worker-0 \d+% .*worker-1 \d+%", summary)
    assert len(re.findall(r"^\[\s*\d+/12\]", out, re.M)) == 12, "one plain line per request (no live view)"
    assert "\x1b[" not in out, "plain output when stdout is not a terminal"
    assert proc.alive_descendants(timeout=10) == []
    assert took < 120, f"the demo took {took:.0f}s"


def _cached_smollm2() -> Path:
    from kvserve.cluster.model_fetch import MARKER, default_model_dir

    d = default_model_dir("smollm2-135m-instruct")
    if not (d / MARKER).is_file():
        pytest.skip(f"SmolLM2-135M-Instruct not fetched ({d}; `kvserve model fetch smollm2-135m-instruct`)")
    return d


def test_demo_chats_with_the_cached_model(tmp_path: Path) -> None:
    """With SmolLM2 in the cache (no download here): users' questions under a shared system prompt,
    each answer printed under its question, prefix-cache hits from the shared system prompt."""
    model = _cached_smollm2()
    proc, rc, _ = _demo(["--requests", "4", "--no-live"], clean_env(XDG_CACHE_HOME=str(tmp_path)), limit_s=400)
    out = proc.out
    print(out)
    assert rc == 0, proc.err[-4000:]
    assert f"model: {model}" in out and "falling back" not in out
    assert not (tmp_path / "kvserve" / "models" / "tiny-llama").exists(), "no random model was written"
    summary = out[out.index("kvserve demo summary") :]
    assert "4 ok, 0 failed: 4 users' questions sharing a system prompt" in summary
    hit = float(re.search(r"hit rate ([\d.]+)%", summary).group(1))
    assert hit > 0, "the users share a system prompt: some of it comes from the prefix cache"
    assert len(re.findall(r"^\[\s*\d+/4\] user ", out, re.M)) == 4
    questions = re.findall(r"^    Q: (.+)$", out, re.M)
    assert len(questions) == 4 and "What is the capital of France?" in questions
    france = out[out.index("Q: What is the capital of France?") :]
    assert re.match(r"Q: What is the capital of France\?\n    A: .*Paris", france), france[:300]
    assert proc.alive_descendants(timeout=10) == []
