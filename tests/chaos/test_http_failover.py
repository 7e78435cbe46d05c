"""OpenAI HTTP streams through a worker SIGKILL, on a real ``kvserve serve`` with API keys
(``--auth-keys``) and ``--http-port``: ``/v1/completions`` and ``/v1/chat/completions`` SSE streams
(greedy) continue after their worker dies and their concatenated text and token ids equal an
undisturbed run's; a wrong or missing key is refused 401 (HTTP) / UNAUTHENTICATED (gRPC) while
the cluster is failing over. Ends with the cluster idle: all blocks free, every pool intact."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import pytest

from kvserve.protos.kvserve.v1 import serving_pb2_grpc
from kvserve.router.gate.tenancy import hash_key
from tests.chaos.conftest import ServedCluster, serve_cluster, stop_cluster
from tests.chaos.streams import prompt, request
from tests.chaos.test_failover import RESTART_TIMEOUT_S, _wait_status, _worker
from tests.integration.test_serve import HTTP_LINE

KEY = "key-of-the-chaos-team"
MAX_TOKENS = 128  # 6 streams of ~10 blocks fit one worker's 64 after the kill
HTTP_TIMEOUT_S = 240.0


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServedCluster, str]]:
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps({"keys": [{"sha256": hash_key(KEY), "tenant": "chaos"}]}))
    c = serve_cluster(tiny_llama_dir, "--auth-keys", str(keys), "--http-port", "0",
                      metadata=(("authorization", f"Bearer {KEY}"),))  # fmt: skip
    try:
        base = c.proc.wait_for_line(HTTP_LINE, timeout=10).group(1)
        yield c, base
    finally:
        stop_cluster(c)


@dataclass
class SseStream:
    """One streamed completion or chat call read to its end on a thread."""

    url: str
    body: dict
    key: str = KEY
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: dict | None = None
    status: int | None = None
    done_marker: bool = False
    chunks: int = 0
    started: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)

    def start(self) -> SseStream:
        threading.Thread(target=self._run, daemon=True).start()
        return self

    def _run(self) -> None:
        try:
            headers = {"authorization": f"Bearer {self.key}"}
            with httpx.stream("POST", self.url, json=self.body, headers=headers, timeout=HTTP_TIMEOUT_S) as resp:
                self.status = resp.status_code
                for line in resp.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line.removeprefix("data: ")
                    if data == "[DONE]":
                        self.done_marker = True
                        continue
                    event = json.loads(data)
                    if "error" in event:
                        self.error = event["error"]
                        continue
                    for choice in event["choices"]:
                        delta = choice.get("delta", {}).get("content", "") if "delta" in choice else choice["text"]
                        self.text += delta or ""
                        self.token_ids.extend(choice.get("token_ids") or [])
                        self.finish_reason = choice.get("finish_reason") or self.finish_reason
                    self.chunks += 1
                    if len(self.token_ids) >= 3:
                        self.started.set()
        finally:
            self.started.set()
            self.done.set()

    def wait(self, timeout: float) -> SseStream:
        assert self.done.wait(timeout), f"{self.url} not done in {timeout}s: {len(self.token_ids)} tokens"
        return self


def _bodies() -> list[tuple[str, dict]]:
    common = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True}
    out = []
    for i in range(3):
        out.append(("/completions", {**common, "prompt": f"The chaos stream number {i} says"}))
        out.append(("/chat/completions", {**common, "messages": [{"role": "user", "content": f"Tell story {i}."}]}))
    return out


def _run(base: str) -> list[SseStream]:
    streams = [SseStream(base + path, body).start() for path, body in _bodies()]
    for s in streams:
        s.wait(HTTP_TIMEOUT_S + 30)
    return streams


def _check_complete(streams: list[SseStream]) -> None:
    for s in streams:
        assert s.status == 200 and s.error is None and s.done_marker, (s.url, s.status, s.error)
        assert s.finish_reason == "length" and len(s.token_ids) == MAX_TOKENS, (s.url, s.finish_reason)


def test_http_sse_streams_continue_through_a_worker_kill_and_wrong_keys_stay_out(
    cluster: tuple[ServedCluster, str],
) -> None:
    c, base = cluster
    reference = _run(base)
    _check_complete(reference)
    c.wait_idle()
    before = c.status()

    streams = [SseStream(base + path, body).start() for path, body in _bodies()]
    for s in streams:
        assert s.started.wait(120), "no first tokens"
    running = {w.worker_id: w.report.num_running for w in c.status().workers}
    victim = max(running, key=running.__getitem__)
    assert running[victim] > 0, f"no worker runs a stream: {running}"
    t_kill = time.monotonic()
    c.kill_worker(victim)

    # During the failover: a wrong key, and none, are refused on both APIs.
    for headers in ({"authorization": "Bearer not-a-key"}, {}):
        r = httpx.post(base + "/completions", json={"prompt": "x", "max_tokens": 2}, headers=headers, timeout=30)
        assert r.status_code == 401, (r.status_code, r.text)
    with grpc.insecure_channel(c.address) as ch, pytest.raises(grpc.RpcError) as e:
        list(serving_pb2_grpc.KVServeStub(ch).Generate(request(prompt(1), 2), timeout=30,
                                                        metadata=(("authorization", "Bearer not-a-key"),)))  # fmt: skip
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    refused_during = any(not s.done.is_set() for s in streams)

    for s in streams:
        s.wait(HTTP_TIMEOUT_S + 30)
    _check_complete(streams)
    for s, ref in zip(streams, reference, strict=True):
        assert s.token_ids == ref.token_ids, f"{s.url}: token ids differ from the undisturbed run"
        assert s.text == ref.text, f"{s.url}: text differs from the undisturbed run"
    after = c.status()
    replays = after.router.replays_total - before.router.replays_total
    assert replays >= 1, "no stream was replayed: the kill hit nothing"

    back = _wait_status(c, lambda st: (w := _worker(st, victim)).state == "up" and w.healthy
                        and w.restarts_total > _worker(before, victim).restarts_total,
                        RESTART_TIMEOUT_S, f"{victim} back up")  # fmt: skip
    t_restart = time.monotonic() - t_kill
    c.wait_idle()
    print(f"\nFIGURES HTTP SSE through a worker kill (API keys on): streams {len(streams)} (completions + chat), "
          f"running on the dead worker per its last report {running[victim]}, replayed {replays}, identical text "
          f"and ids {len(streams)}/"
          f"{len(streams)}; wrong/missing key refused 401 (gRPC UNAUTHENTICATED) "
          f"{'while streams were failing over' if refused_during else 'after the streams ended'}; "
          f"{victim} back up {t_restart:.1f}s after the kill (restarts {_worker(back, victim).restarts_total}); "
          "blocks leaked 0")  # fmt: skip
