"""``kvserve serve --frontends 2``: the client APIs served by two frontend processes on one shared port
(SO_REUSEPORT), relayed to the router over one GenerateStream each (frontend/, docs/architecture.md
section 1). A real serve, the tiny random Llama, 2 CPU workers, real gRPC and HTTP on 127.0.0.1.

* gRPC (token ids, text, chat; Generate and GenerateStream) and HTTP/SSE streaming through the
  frontends give the greedy tokens the router gives when clients call it directly (``--frontends 0``'s
  path, on the same cluster).
* A worker SIGKILLed while streams go through a frontend: every stream continues token-identical
  (ordering and de-duplication across the replay are the router's, carried unchanged over the mux);
  likewise a worker drained under them (each started stream moved by live migration, no replay).
* A frontend SIGKILLed mid-stream: its streams end UNAVAILABLE (gRPC) or with their connection closed
  before ``[DONE]`` (HTTP/SSE) with a prefix of the right tokens, the router keeps their requests for the
  owner's grace (a client may resume them elsewhere) and no used block is left after it, the other
  frontend's streams complete token-identical, a new request on the
  same port succeeds, and Ray restarts the frontend.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.protos.kvserve.v1 import serving_pb2_grpc
from kvserve.router.requests.owned import OWNER_GRACE_S
from tests.chaos.conftest import ServedCluster, serve_cluster, stop_cluster
from tests.chaos.streams import Stream, prompt, request, run_all
from tests.chaos.test_drain import drain_under_streams
from tests.chaos.test_failover import _mixed_requests, _wait_status
from tests.integration.test_serve import HTTP_LINE, Proc, clean_env, kvserve_argv

FRONTEND_LINE = re.compile(r"(\d+) frontends serving gRPC kvserve.v1.KVServe on (\S+)")
FRONTEND_HEADER = "kvserve-frontend"


@dataclass
class Fronted:
    cluster: ServedCluster
    frontend: str  # the frontends' shared gRPC host:port
    http: str  # the frontends' shared HTTP base URL (.../v1)

    def frontend_pid(self, frontend_id: str) -> int:
        index = int(frontend_id.rsplit("-", 1)[1])
        pid = int(self.cluster._ask({"op": "frontend_pid", "index": index}))
        self.cluster.proc.note_descendants()
        assert pid in self.cluster.proc.descendants, f"{frontend_id} pid {pid} is not a process serve started"
        return pid


@pytest.fixture(scope="module")
def fronted(tiny_llama_dir: Path) -> Iterator[Fronted]:
    c = serve_cluster(tiny_llama_dir, "--frontends", "2", "--frontend-port", "0", "--http-port", "0")
    try:
        m = c.proc.wait_for_line(FRONTEND_LINE, timeout=120)
        assert m.group(1) == "2"
        http = c.proc.wait_for_line(HTTP_LINE, timeout=30).group(1)
        yield Fronted(c, m.group(2), http)
    finally:
        stop_cluster(c)


def _stream_tokens(address: str, req: spb.GenerateRequest) -> tuple[list[int], str]:
    with grpc.insecure_channel(address) as ch:
        responses = list(serving_pb2_grpc.KVServeStub(ch).Generate(req, timeout=120))
    assert responses[-1].finish_reason
    return [t for r in responses for t in r.token_ids], "".join(r.text_delta for r in responses)


def _sse_tokens(url: str, body: dict) -> tuple[list[int], str]:
    ids: list[int] = []
    text = ""
    with httpx.stream("POST", url, json={**body, "stream": True, "return_token_ids": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                ids.extend(choice.get("token_ids") or ())
                text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return ids, text


def test_grpc_and_http_through_frontends_equal_the_router_direct(fronted: Fronted) -> None:
    c, front = fronted.cluster, fronted.frontend
    greedy = spb.SamplingParams(max_tokens=12, ignore_eos=True)
    reqs = [
        spb.GenerateRequest(token_ids=spb.TokenIds(ids=prompt(1)), sampling=greedy),
        spb.GenerateRequest(text="the cache of a router", sampling=greedy),  # tokenized by the frontend
        spb.GenerateRequest(
            messages=spb.ChatMessages(messages=[spb.ChatMessage(role="user", content="hi there")]), sampling=greedy
        ),  # fmt: skip
    ]
    for req in reqs:
        direct = _stream_tokens(c.address, req)
        assert len(direct[0]) == 12
        assert _stream_tokens(front, req) == direct, req.WhichOneof("prompt")

    # GenerateStream through a frontend: one stream, several requests, unbatched by id.
    async_reqs = [
        spb.GenerateStreamRequest(generate=spb.GenerateRequest(
            request_id=f"m{i}", token_ids=spb.TokenIds(ids=prompt(20 + i)), sampling=greedy))
        for i in range(3)
    ]  # fmt: skip
    got: dict[str, list[int]] = {}
    with grpc.insecure_channel(front) as ch:
        for batch in serving_pb2_grpc.KVServeStub(ch).GenerateStream(iter(async_reqs), timeout=120):
            assert not batch.errors, batch.errors
            for resp in batch.responses:
                got.setdefault(resp.request_id, []).extend(resp.token_ids)
    for i, m in enumerate(async_reqs):
        assert got[f"m{i}"] == _stream_tokens(c.address, m.generate)[0]

    # HTTP/SSE on the frontends' shared port: completion (ids and text prompt) and chat.
    ids, _ = _sse_tokens(f"{fronted.http}/completions", {"prompt": prompt(1), "max_tokens": 12, "ignore_eos": True})
    assert ids == _stream_tokens(c.address, reqs[0])[0]
    ids, _ = _sse_tokens(f"{fronted.http}/completions",
                         {"prompt": "the cache of a router", "max_tokens": 12, "ignore_eos": True})  # fmt: skip
    assert ids == _stream_tokens(c.address, reqs[1])[0]
    ids, text = _sse_tokens(f"{fronted.http}/chat/completions",
                            {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 12,
                             "ignore_eos": True})  # fmt: skip
    assert (ids, text) == _stream_tokens(c.address, reqs[2])
    # A refusal is the router's, as an HTTP status before any body.
    r = httpx.post(f"{fronted.http}/completions", json={"prompt": [10**8], "max_tokens": 4}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    c.wait_idle()


def test_worker_sigkill_streams_through_a_frontend_continue_token_identical(fronted: Fronted) -> None:
    c = fronted.cluster
    max_tokens = 160
    reqs = _mixed_requests(8, 400, max_tokens)
    reference = run_all(c.address, reqs)  # the router direct, undisturbed
    assert all(s.code == grpc.StatusCode.OK and len(s.tokens) == max_tokens for s in reference)
    c.wait_idle()

    streams = [Stream(fronted.frontend, r, first_tokens=3).start() for r in reqs]
    for s in streams:
        assert s.started.wait(120), "no first tokens"
    # NOTE: the worker holding most streams (whichever kinds it got: placement order through the
    # frontend's relay is the threads' arrival order, not the failover test's pattern)
    holders = [s.last_worker for s in streams]
    victim = max(set(holders), key=holders.count)
    c.kill_worker(victim)
    for s in streams:
        s.wait(240)
    moved = [s for s in streams if victim in s.worker_ids and len(set(s.worker_ids)) > 1]
    for s, ref in zip(streams, reference, strict=True):
        assert s.code == grpc.StatusCode.OK, (s.req.request_id, s.code, s.details)
        assert s.tokens == ref.tokens, "a stream replayed through a frontend differs from the undisturbed run"
        assert s.final is not None and s.final.usage.completion_tokens == max_tokens
        if s in moved:
            assert s.final.num_replays == 1 and s.final.num_migrations >= 1
    assert moved, f"no stream was on {victim} when it died; nothing was tested"
    _wait_status(c, lambda st: all(w.state == "up" and w.healthy for w in st.workers), 240, "workers back up")
    c.wait_idle()


def test_a_live_migration_of_streams_through_a_frontend_keeps_them_token_identical(fronted: Fronted) -> None:
    """A live migration (a drain moves every started stream off a worker) under streams relayed by
    a frontend: each stream continues token-identical, no replay. NOTE: the source is paused at a
    step boundary before its export, so the destination's first tokens follow its last ones in
    order here (the router's demux holds and de-duplicates where they would not: resends after a
    reconnect, replays; tests/unit/test_router_demux.py); this covers the path end to end: the move, the
    worker change mid-stream, the mux and the frontend's relay. It fails if a moved stream loses,
    repeats or reorders a token anywhere on that path."""
    c = fronted.cluster
    run = drain_under_streams(c, fronted.frontend, _mixed_requests(8, 800, 96))
    c.wait_idle()
    print(f"\nFIGURES migration through a frontend: {len(run.moved)} of {len(run.streams)} streams moved off "
          f"{run.victim} ({run.progress[-1].requests_migrated} migrated), 0 replays, all token-identical")  # fmt: skip


def _by_frontend(open_one: Callable[[int], tuple[Any, str]], per_frontend: int,
                 timeout_s: float = 120.0) -> dict[str, list[Any]]:  # fmt: skip
    """Connections grouped by the frontend that serves each (``open_one(i)`` opens the i-th and
    returns it with that frontend's name, closing it itself if not kept): the kernel spreads
    connections over the frontends, so open them until each has ``per_frontend``. NOTE: until a
    deadline, not a count: a frontend Ray just restarted (an earlier test's kill) takes new
    connections only once it has bound the port again; until then the other one gets them all."""
    groups: dict[str, list[Any]] = {}
    deadline, i = time.monotonic() + timeout_s, 0
    while time.monotonic() < deadline and not (
        len(groups) == 2 and all(len(v) >= per_frontend for v in groups.values())
    ):
        conn, frontend_id = open_one(i)
        i += 1
        group = groups.setdefault(frontend_id, [])
        if len(group) < per_frontend:
            group.append(conn)
        else:
            conn.close()
            time.sleep(0.05)
    assert set(groups) == {"frontend-0", "frontend-1"} and all(
        len(v) >= per_frontend for v in groups.values()
    ), {k: len(v) for k, v in groups.items()}
    return groups


def _connections(address: str, per_frontend: int) -> dict[str, list[grpc.Channel]]:
    """gRPC channels, each its own TCP connection (not the process-wide subchannel pool), by the
    frontend named in a 1-token Generate's ``kvserve-frontend`` metadata."""

    def open_one(i: int) -> tuple[grpc.Channel, str]:
        ch = grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        call = serving_pb2_grpc.KVServeStub(ch).Generate(request(prompt(900 + i % 64, 4), 1), timeout=60)
        assert [r.finish_reason for r in call][-1] == "length"
        return ch, dict(call.initial_metadata())[FRONTEND_HEADER]

    return _by_frontend(open_one, per_frontend)


def test_frontend_sigkill_ends_its_streams_frees_their_blocks_and_the_port_serves_on(fronted: Fronted) -> None:
    c = fronted.cluster
    long, short = 400, 40  # NOTE: the dead frontend's requests are long: finishing them would take ~400 steps
    by_frontend = _connections(fronted.frontend, per_frontend=2)
    victim, survivor = "frontend-0", "frontend-1"
    pid = fronted.frontend_pid(victim)  # NOTE: before the streams, so they are killed early on
    cut = [Stream(fronted.frontend, request(prompt(600 + i), long), channel=ch).start()
           for i, ch in enumerate(by_frontend[victim][:2])]  # fmt: skip
    kept = [Stream(fronted.frontend, request(prompt(610 + i), short), channel=ch).start()
            for i, ch in enumerate(by_frontend[survivor][:2])]  # fmt: skip
    for s in cut + kept:
        assert s.started.wait(120), "no first tokens"
    steps_before = {w.worker_id: w.report.decode_steps for w in c.status().workers}
    t_kill = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    for s in cut + kept:
        s.wait(240)
    # NOTE: the router keeps the dead frontend's placed requests for its owner's grace (a client may resume them
    # through another frontend, or the frontend re-open its stream: kvserve/router/requests/owned.py
    # ``stream_ended``), then cancels what nobody took: either way every block is free within the grace.
    idle = c.wait_idle(timeout=OWNER_GRACE_S + 60)
    steps = {w.worker_id: w.report.decode_steps - steps_before[w.worker_id] for w in idle.workers}

    reference = run_all(c.address, [s.req for s in cut + kept])  # the router direct, undisturbed
    for s, ref in zip(cut + kept, reference, strict=True):
        assert ref.code == grpc.StatusCode.OK and len(ref.tokens) == s.req.sampling.max_tokens
    for s, ref in zip(cut, reference[: len(cut)], strict=True):
        assert s.code == grpc.StatusCode.UNAVAILABLE, (s.code, s.details)
        assert s.tokens == ref.tokens[: len(s.tokens)] and len(s.tokens) < long
    for s, ref in zip(kept, reference[len(cut) :], strict=True):
        assert s.code == grpc.StatusCode.OK, (s.code, s.details)
        assert s.tokens == ref.tokens, "a stream of the surviving frontend differs from the undisturbed run"

    # The same port serves on at once (the survivor), and Ray brings the dead frontend back.
    (after,) = run_all(fronted.frontend, [request(prompt(700), 16)])
    assert after.code == grpc.StatusCode.OK and after.tokens == run_all(c.address, [after.req])[0].tokens
    new_pid = fronted.frontend_pid(victim)  # NOTE: the probe's call waits for the restarted actor
    assert new_pid != pid
    print(f"\nFIGURES frontend kill: cut {len(cut)}, kept {len(kept)}, steps after the kill {steps}, "
          f"restarted within {time.monotonic() - t_kill:.1f}s")  # fmt: skip
    for channels in by_frontend.values():
        for ch in channels:
            ch.close()
    c.wait_idle()


class _SseStream:
    """One streaming completion on its own thread over ``client``'s kept-alive connection: the
    token ids received, whether ``[DONE]`` came, and what ended it otherwise."""

    def __init__(self, client: httpx.Client, url: str, body: dict) -> None:
        self.client, self.url, self.body = client, url, body
        self.ids: list[int] = []
        self.done = False
        self.error: BaseException | None = None
        self.started, self.ended = threading.Event(), threading.Event()
        self.ended_at: float | None = None
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            with self.client.stream("POST", self.url, json={**self.body, "stream": True, "return_token_ids": True},
                                    timeout=120) as r:  # fmt: skip
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        for choice in json.loads(line[6:])["choices"]:
                            self.ids.extend(choice.get("token_ids") or ())
                        if self.ids:
                            self.started.set()
        except Exception as e:  # noqa: BLE001 - what the client saw is the result
            self.error = e
        finally:
            self.ended_at = time.monotonic()
            self.started.set()
            self.ended.set()


def _http_clients(http: str, per_frontend: int) -> dict[str, list[httpx.Client]]:
    """HTTP clients with one kept-alive connection each, by the frontend its ``kvserve-frontend``
    response header names."""

    def open_one(_: int) -> tuple[httpx.Client, str]:
        client = httpx.Client(limits=httpx.Limits(max_connections=1, max_keepalive_connections=1))
        r = client.get(f"{http}/models", timeout=30)
        assert r.status_code == 200, r.text
        return client, r.headers[FRONTEND_HEADER]

    return _by_frontend(open_one, per_frontend)


def test_frontend_sigkill_ends_its_http_streams_at_once_and_frees_their_blocks(fronted: Fronted) -> None:
    """HTTP/SSE through a frontend that is SIGKILLed mid-stream: its clients' connections close at
    once (an incomplete stream: no ``[DONE]``, so an OpenAI client raises; never a hang), with a
    prefix of the right tokens; the router keeps their requests for the owner's grace, then frees them
    (no used block); the other frontend's streams complete token-identical."""
    c = fronted.cluster
    long, short = 400, 40
    url = f"{fronted.http}/completions"
    clients = _http_clients(fronted.http, per_frontend=2)
    victim, survivor = "frontend-1", "frontend-0"
    pid = fronted.frontend_pid(victim)
    bodies = [{"prompt": prompt(620 + i), "max_tokens": n, "ignore_eos": True}
              for i, n in enumerate((long, long, short, short))]  # fmt: skip
    cut = [_SseStream(cl, url, b) for cl, b in zip(clients[victim][:2], bodies[:2], strict=True)]
    kept = [_SseStream(cl, url, b) for cl, b in zip(clients[survivor][:2], bodies[2:], strict=True)]
    for s in cut + kept:
        assert s.started.wait(120) and s.ids, f"no first tokens ({s.error!r})"
    steps_before = {w.worker_id: w.report.decode_steps for w in c.status().workers}
    t_kill = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    for s in cut + kept:
        assert s.ended.wait(240), "a stream hangs"
    idle = c.wait_idle(timeout=OWNER_GRACE_S + 60)  # NOTE: kept for the owner's grace, then freed (as above)
    steps = {w.worker_id: w.report.decode_steps - steps_before[w.worker_id] for w in idle.workers}
    for s in cut:
        assert not s.done and s.error is not None, "a cut stream looked complete"
        assert s.ended_at is not None and s.ended_at - t_kill < 10, "the client learnt of the kill late"
    for s in kept:
        assert s.done and s.error is None and len(s.ids) == short, (s.error, len(s.ids))
    # The undisturbed tokens, through the same port (the survivor, or the restarted frontend).
    for s in cut + kept:
        ref, _ = _sse_tokens(url, s.body)
        assert len(ref) == s.body["max_tokens"] and s.ids == ref[: len(s.ids)]
    for group in clients.values():
        for client in group:
            client.close()
    print(f"\nFIGURES frontend kill (HTTP/SSE): cut {len(cut)} ({[type(s.error).__name__ for s in cut]}, "
          f"{max(s.ended_at - t_kill for s in cut):.2f}s after the kill), kept {len(kept)} identical, "
          f"steps after the kill {steps}")  # fmt: skip
    c.wait_idle()


PLAIN_FRONTEND_LINE = re.compile(r"frontend plain serving gRPC kvserve.v1.KVServe on (\S+),")


def test_kvserve_frontend_as_a_plain_process_relays_to_the_router(fronted: Fronted) -> None:
    """The deploy entry point (a Kubernetes frontend pod runs it): its own ports, the router's address."""
    c = fronted.cluster
    proc = Proc(kvserve_argv("frontend", "--router", c.address, "--model", str(c.model_dir), "--grpc-port", "0",
                             "--http-port", "0", "--frontend-id", "plain"), clean_env())  # fmt: skip
    try:
        address = proc.wait_for_line(PLAIN_FRONTEND_LINE, timeout=120).group(1)
        http = proc.wait_for_line(HTTP_LINE, timeout=30).group(1)
        req = spb.GenerateRequest(text="a plain frontend", sampling=spb.SamplingParams(max_tokens=8, ignore_eos=True))
        assert _stream_tokens(address, req) == _stream_tokens(c.address, req)
        ids, _ = _sse_tokens(f"{http}/completions", {"prompt": "a plain frontend", "max_tokens": 8, "ignore_eos": True})
        assert ids == _stream_tokens(c.address, req)[0]
        proc.popen.send_signal(signal.SIGTERM)
        assert proc.popen.wait(timeout=30) == 0
    finally:
        if proc.popen.poll() is None:
            proc.kill_tree()
    c.wait_idle()


ROUTER_RESTARTED = re.compile(r"router restarted \(1\)")


def _largest_gap_after(times: list[float], t: float) -> float:
    """The longest wait between consecutive responses (or from ``t`` to the first one) after ``t``."""
    later = [x for x in times if x >= t]
    gaps = [b - a for a, b in zip([t, *later], later, strict=False)]
    return max(gaps, default=0.0)


def test_router_death_under_frontends_interrupts_no_stream(fronted: Fronted) -> None:
    """Last in this module (it replaces the router). 16 streams through the frontends (gRPC greedy and
    seeded, HTTP/SSE), the router SIGKILLed mid-stream: the workers stream to the frontends that own the
    requests (docs/architecture.md section 2a), so every stream completes with the undisturbed tokens; the
    restarted router adopts the running requests from the workers' tables (no block leaked, restart
    counts kept) and serves new calls on the frontends' port."""
    c = fronted.cluster
    max_tokens = 300
    reqs = _mixed_requests(12, 760, max_tokens)
    bodies = [{"prompt": prompt(790 + i), "max_tokens": max_tokens, "ignore_eos": True} for i in range(4)]
    reference = run_all(c.address, reqs)
    assert all(s.code == grpc.StatusCode.OK and len(s.tokens) == max_tokens for s in reference)
    ref_http = [_sse_tokens(f"{fronted.http}/completions", b)[0] for b in bodies]
    c.wait_idle()
    before = {w.worker_id: w.restarts_total for w in c.status().workers}
    grpc_streams = [Stream(fronted.frontend, r, first_tokens=3).start() for r in reqs]
    http = [_SseStream(httpx.Client(), f"{fronted.http}/completions", b) for b in bodies]
    for s in grpc_streams:
        assert s.started.wait(120), "no first tokens"
    for h in http:
        assert h.started.wait(120) and h.ids, f"no first tokens ({h.error!r})"
    t_kill = time.monotonic()
    os.kill(c.router_pid(), signal.SIGKILL)
    for s in grpc_streams:
        s.wait(240)
    for h in http:
        assert h.ended.wait(240), "an HTTP stream hangs"
    for s, ref in zip(grpc_streams, reference, strict=True):
        assert s.code == grpc.StatusCode.OK, (s.code, s.details)
        assert s.tokens == ref.tokens, "a stream differs from the undisturbed run after the router's death"
        assert s.ended_at is not None and s.ended_at > t_kill, "a stream ended before the kill: nothing was tested"
    for h, ref in zip(http, ref_http, strict=True):
        assert h.done and h.error is None and h.ids == ref, (h.error, len(h.ids))
    # NOTE: a request the engine preempted (recompute, in this module's small pool) pauses while it waits and
    # re-prefills, kill or no kill: the kill's own cost is the gap of the streams never preempted.
    gap = max(_largest_gap_after(s.times, t_kill) for s in grpc_streams)
    unpreempted = [s for s in grpc_streams if s.final is not None and not s.final.num_preemptions]
    gap_unpreempted = max((_largest_gap_after(s.times, t_kill) for s in unpreempted), default=float("nan"))
    gap_reference = max(_largest_gap_after(s.times, s.times[0]) for s in reference)

    restarted, restarted_at = c.proc.wait_for_dated_line(ROUTER_RESTARTED, timeout=240)
    t_restart = restarted_at - t_kill
    c.wait_idle(timeout=120)  # every block back: the adopted requests finished and were released
    reqs_after = [request(prompt(740 + i), 16) for i in range(2)]
    through = run_all(fronted.frontend, reqs_after, timeout=120)
    direct = run_all(c.address, reqs_after)
    assert all(s.code == grpc.StatusCode.OK and len(s.tokens) == 16 for s in through), [s.details for s in through]
    assert [s.tokens for s in through] == [s.tokens for s in direct]
    after = {w.worker_id: w.restarts_total for w in c.status().workers}
    assert after == before, f"restart counts changed across the router's death: {before} -> {after}"
    c.wait_idle()
    print(f"\nFIGURES router kill under frontends: {len(grpc_streams)} gRPC + {len(http)} HTTP streams all "
          f"completed token-identical; largest gap after the kill {gap_unpreempted:.2f}s in the {len(unpreempted)} "
          f"never preempted ({gap:.2f}s with the preempted; undisturbed run {gap_reference:.2f}s); router serving "
          f"again {t_restart:.1f}s after the kill ({restarted.string.strip()})")  # fmt: skip
