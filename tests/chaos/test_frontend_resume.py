"""A client whose frontend crashed resumes its stream through another frontend, from its cursor, token-identical
(issue 41 item 3; docs/architecture.md 2a "Resuming through another frontend").

A 2-worker ``kvserve serve`` (tiny model, CPU, API keys of two tenants) and two ``kvserve frontend`` processes that
own their requests (data services; real gRPC and HTTP on 127.0.0.1, real Ray).

* Attacks at the trust boundary, both frontends alive: a resume through the other frontend with a wrong token,
  with another tenant's key, for an unknown id, for a request that finished: each refused NOT_FOUND, and the
  stream it aimed at runs on untouched (token-identical, never moved).
* The frontend SIGKILLed under sync and async ``KVServeClient`` streams (greedy and seeded) given both
  frontends' addresses: every stream resumes through the other and ends token- and text-identical to an
  undisturbed run (no token duplicated or missing), one of them only after its request finished on its worker
  while its owner was dead (its tail resent once), and one cancelled by its client after its resume (it ends
  CANCELLED with a prefix of the right tokens); two HTTP/SSE completions (greedy, seeded) resume the same way
  through the other frontend's HTTP API (the ``kvserve-resume`` header), and a third (greedy, ``logprobs: 2``)
  with one logprobs entry per token across the cut, each the greedy token's with the undisturbed run's values;
  no KV block is left used.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from kvserve.cluster.client import AsyncKVServeClient, KVServeClient
from kvserve.frontend.server import FRONTEND_KEY_ENV
from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.protos.kvserve.v1 import serving_pb2_grpc
from kvserve.router.api.openai_output import TokenText
from kvserve.router.gate.tenancy import hash_key
from kvserve.workers.text.tokenizer import load_tokenizer
from tests.chaos.conftest import ServedCluster, serve_cluster, stop_cluster
from tests.chaos.streams import prompt
from tests.chaos.test_router_death import ROUTER_RESTARTED
from tests.integration.test_serve import HTTP_LINE, Proc, clean_env, kvserve_argv

FRONTEND_LINE = re.compile(r"frontend \S+ serving gRPC kvserve.v1.KVServe on (\S+),")
KEY_A, KEY_B = "key-of-tenant-alpha", "key-of-tenant-beta"
BLOCKS = "512"  # per worker: every stream below fits without preemption
TIMEOUT_S = 300.0


@dataclass
class Frontends:
    cluster: ServedCluster
    procs: list[Proc]
    addresses: list[str]
    http: list[str]  # each frontend's HTTP base URL (.../v1)
    frontend_key: str = ""
    keys: Path | None = None


@pytest.fixture(scope="module")
def fronts(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Frontends]:
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps({"keys": [{"sha256": hash_key(KEY_A), "tenant": "alpha"},
                                         {"sha256": hash_key(KEY_B), "tenant": "beta"}]}))  # fmt: skip
    key = os.urandom(16).hex()
    old = os.environ.get(FRONTEND_KEY_ENV)
    os.environ[FRONTEND_KEY_ENV] = key  # NOTE: serve's router trusts a frontend holding it; clean_env passes it on
    try:
        c = serve_cluster(tiny_llama_dir, "--num-gpu-blocks", BLOCKS, "--auth-keys", str(keys),
                          metadata=(("authorization", f"Bearer {KEY_A}"),))  # fmt: skip
    finally:
        if old is None:
            del os.environ[FRONTEND_KEY_ENV]
        else:
            os.environ[FRONTEND_KEY_ENV] = old
    procs: list[Proc] = []
    try:
        for i in range(2):
            procs.append(_frontend(c, f"fe{i}", key, keys))
        addresses = [p.wait_for_line(FRONTEND_LINE, timeout=120).group(1) for p in procs]
        http = [p.wait_for_line(HTTP_LINE, timeout=60).group(1) for p in procs]
        yield Frontends(c, procs, addresses, http, key, keys)
    finally:
        for p in procs:
            if p.popen.poll() is None:
                p.kill_tree()
        stop_cluster(c)


def _frontend(c: ServedCluster, frontend_id: str, key: str, keys: Path) -> Proc:
    """A ``kvserve frontend`` process in front of ``c``'s router (gRPC and HTTP on ports of its own)."""
    return Proc(kvserve_argv("frontend", "--router", c.address, "--model", str(c.model_dir), "--grpc-port", "0",
                             "--http-port", "0", "--frontend-id", frontend_id, "--auth-keys", str(keys)),
                clean_env(**{FRONTEND_KEY_ENV: key}))  # fmt: skip


def _kwargs(max_tokens: int, seed: int | None) -> dict[str, Any]:
    """Greedy, or sampled with ``seed``; every request runs to ``max_tokens``."""
    kw: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": True}
    if seed is not None:
        kw.update(temperature=0.8, seed=seed)
    return kw


def _reference(c: ServedCluster, jobs: list[tuple[list[int], dict[str, Any]]]) -> list[tuple[list[int], str]]:
    """The router direct, undisturbed: (tokens, text) per job."""

    def one(job: tuple[list[int], dict[str, Any]]) -> tuple[list[int], str]:
        with KVServeClient(c.address, auth_token=KEY_A, timeout=TIMEOUT_S) as client:
            ids, text, final = client.generate_all(job[0], **job[1])
        assert final.finish_reason == "length" and len(ids) == job[1]["max_tokens"]
        return ids, text

    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(one, jobs))


def _reference_logprobs(c: ServedCluster, job: tuple[list[int], dict[str, Any]]) -> list[dict[int, float]]:
    """The router direct, undisturbed: each token's logprobs."""
    with KVServeClient(c.address, auth_token=KEY_A, timeout=TIMEOUT_S) as client:
        return [dict(lp.logprobs) for resp in client.generate(job[0], **job[1]) for lp in resp.logprobs]


@dataclass
class Reader:
    """One ``generate`` read to its end: what it yielded, its final response, its resumes, what ended it.
    ``hold``: after its first tokens it stops reading until the event is set (its request runs on)."""

    ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, float]] = field(default_factory=list)  # per token, when it asked for them
    times: list[float] = field(default_factory=list)  # monotonic arrival of each response
    final: spb.GenerateResponse | None = None
    resumes: int = 0
    error: BaseException | None = None
    token: str = ""
    request_id: str = ""
    hold: threading.Event | None = None
    cancel_after_resume: int = 0  # >0: cancel the stream once it got this many tokens after its resume
    started: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)

    def take(self, resp: spb.GenerateResponse) -> None:
        self.ids.extend(resp.token_ids)
        self.text += resp.text_delta
        self.logprobs.extend(dict(lp.logprobs) for lp in resp.logprobs)
        self.times.append(time.monotonic())
        if resp.finish_reason:
            self.final = resp

    def read_sync(self, addresses: list[str], prompt_ids: list[int], kw: dict[str, Any], key: str = KEY_A) -> None:
        try:
            with KVServeClient(addresses, auth_token=key, timeout=TIMEOUT_S) as client:
                stream = client.generate(prompt_ids, **kw)
                for resp in stream:
                    self.take(resp)
                    self.token, self.request_id = stream.cursor.token, stream.cursor.request_id
                    if len(self.ids) >= 3 and not self.started.is_set():
                        self.started.set()
                        if self.hold is not None:
                            self.hold.wait(TIMEOUT_S)
                    if stream.resumes and self.cancel_after_resume and len(self.ids) >= self.cancel_after_resume:
                        stream.cancel()  # NOTE: the new owner aborts it: its blocks must be freed
                self.resumes = stream.resumes
        except BaseException as e:  # noqa: BLE001 - what the client saw is the result
            self.error = e
        finally:
            self.started.set()
            self.done.set()

    async def read_async(self, addresses: list[str], prompt_ids: list[int], kw: dict[str, Any]) -> None:
        try:
            async with AsyncKVServeClient(addresses, auth_token=KEY_A, timeout=TIMEOUT_S) as client:
                stream = client.generate(prompt_ids, **kw)
                async for resp in stream:
                    self.take(resp)
                    if len(self.ids) >= 3:
                        self.started.set()
                self.resumes = stream.resumes
        except BaseException as e:  # noqa: BLE001
            self.error = e
        finally:
            self.started.set()
            self.done.set()


@dataclass
class SseReader:
    """One streamed completion over HTTP/SSE (kvserve's resume extension: the ``kvserve-resume`` header): read on
    a thread through ``bases[0]``; a stream that breaks before ``[DONE]`` is resumed through the next base with
    the ids and text characters it has."""

    bases: list[str]
    body: dict
    ids: list[int] = field(default_factory=list)
    text: str = ""
    done: bool = False  # ``[DONE]`` came
    resumes: int = 0
    # a completion's ``logprobs`` objects (tokens, token_logprobs, top_logprobs, text_offset) concatenated
    logprobs: dict[str, list] = field(default_factory=dict)
    uneven: list[tuple[int, int]] = field(default_factory=list)  # (token ids, logprobs entries) of a chunk unequal
    cuts: list[tuple[int, int]] = field(default_factory=list)  # (tokens, text characters) it had at each resume
    finish: str = ""
    error: BaseException | None = None
    started: threading.Event = field(default_factory=threading.Event)
    ended: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        headers = {"authorization": f"Bearer {KEY_A}"}
        body = {**self.body, "stream": True, "return_token_ids": True}
        resume = ""
        try:
            for base in self.bases:
                try:
                    extra = {"kvserve-resume": f"{resume} {len(self.ids)} {len(self.text)}"} if self.resumes else {}
                    if self.resumes:
                        self.cuts.append((len(self.ids), len(self.text)))
                    with httpx.stream("POST", f"{base}/completions", json=body, headers={**headers, **extra},
                                      timeout=TIMEOUT_S) as r:  # fmt: skip
                        assert r.status_code == 200, r.read()
                        resume = resume or r.headers["kvserve-resume"]
                        for line in r.iter_lines():
                            if line == "data: [DONE]":
                                self.done = True
                            elif line.startswith("data: "):
                                for choice in json.loads(line[6:])["choices"]:
                                    self._take_logprobs(choice)
                                    self.ids.extend(choice.get("token_ids") or ())
                                    self.text += choice.get("text") or ""
                                    self.finish = choice.get("finish_reason") or self.finish
                                if len(self.ids) >= 3:
                                    self.started.set()
                except httpx.HTTPError:
                    pass  # NOTE: the frontend died mid-stream: resume through the next one
                if self.done:
                    return
                self.resumes += 1
        except BaseException as e:  # noqa: BLE001 - what the client saw is the result
            self.error = e
        finally:
            self.started.set()
            self.ended.set()

    def _take_logprobs(self, choice: dict) -> None:
        lp, n = choice.get("logprobs") or {}, len(choice.get("token_ids") or ())
        if "logprobs" not in self.body:
            return
        if len(lp.get("tokens", ())) != n:
            self.uneven.append((n, len(lp.get("tokens", ()))))
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            self.logprobs.setdefault(key, []).extend(lp.get(key, ()))


def _check_sse_logprobs(s: SseReader, ref: list[dict[int, float]], text: TokenText) -> None:
    """A resumed SSE completion's logprobs: one entry per token across the cut (none lost, none repeated), in
    every chunk; each the greedy token's (its text the top one) with the undisturbed run's values (``ref``: the
    gRPC logprobs by token id) within 1e-3; its text offsets go on from the text the client had at the cut."""
    lp, (cut_ids, cut_chars) = s.logprobs, s.cuts[0]
    assert not s.uneven, f"chunks whose logprobs do not match their tokens (tokens, entries): {s.uneven[:5]}"
    assert 0 < cut_ids < len(s.ids) and len(ref) == len(s.ids)
    assert {k: len(v) for k, v in lp.items()} == dict.fromkeys(
        ("tokens", "token_logprobs", "top_logprobs", "text_offset"), len(s.ids)
    ), "a logprobs entry lost or repeated across the cut"
    assert lp["tokens"] == [text(t) for t in s.ids]
    for i, (t, tops, want) in enumerate(zip(s.ids, lp["top_logprobs"], ref, strict=True)):
        best = sorted(want.items(), key=lambda kv: -kv[1])[:2]
        assert best[0][0] == t and max(tops, key=tops.__getitem__) == text(t), (i, t, tops, best)
        assert abs(lp["token_logprobs"][i] - want[t]) < 1e-3, (i, lp["token_logprobs"][i], want[t])
        expected = {text(k): v for k, v in best}
        assert tops.keys() == expected.keys(), (i, tops, expected)
        assert max(abs(tops[k] - v) for k, v in expected.items()) < 1e-3, (i, tops, expected)
    assert lp["text_offset"][cut_ids] == cut_chars, "the resumed offsets restart instead of going on"


def _resume(address: str, key: str, rid: str, token: str, n: int = 0) -> grpc.RpcError | None:
    """One resume call; the error it ended with (None: it streamed)."""
    req = spb.GenerateRequest(request_id=rid, resume=spb.ResumeStream(token=token, num_tokens=n))
    metadata = (("authorization", f"Bearer {key}"),)
    with grpc.insecure_channel(address) as ch:
        try:
            list(serving_pb2_grpc.KVServeStub(ch).Generate(req, timeout=30, metadata=metadata))
        except grpc.RpcError as e:
            return e
    return None


def test_resumes_that_do_not_match_are_refused_and_the_stream_runs_on_untouched(fronts: Frontends) -> None:
    c, (fe0, fe1) = fronts.cluster, fronts.addresses
    jobs = [(prompt(40), _kwargs(300, None)), (prompt(41), _kwargs(8, 77))]
    (ref_long, ref_short) = _reference(c, jobs)
    c.wait_idle()
    short = Reader()
    short.read_sync([fe0], *jobs[1])
    assert short.error is None and short.ids == ref_short[0] and short.token, "a finished stream, read to its end"
    victim = Reader()
    threading.Thread(target=victim.read_sync, args=([fe0], *jobs[0]), daemon=True).start()
    assert victim.started.wait(120) and victim.error is None and victim.token and len(victim.token) == 32
    t0 = time.monotonic()
    attempts = {
        "wrong token": (KEY_A, victim.request_id, secrets.token_hex(16)),
        "another tenant's key": (KEY_B, victim.request_id, victim.token),
        "unknown id": (KEY_A, "req-nobody", victim.token),
        "unknown id and token": (KEY_A, "req-nobody", secrets.token_hex(16)),
        "a finished request": (KEY_A, short.request_id, short.token),
    }
    for what, (key, rid, token) in attempts.items():
        e = _resume(fe1, key, rid, token, n=3)
        assert e is not None and e.code() == grpc.StatusCode.NOT_FOUND, (what, e)
        assert victim.token not in (e.details() or ""), "a refusal never echoes a token"
    refused_s = time.monotonic() - t0
    assert victim.done.wait(TIMEOUT_S)
    assert victim.error is None, victim.error
    assert victim.final is not None and victim.final.finish_reason == "length"
    assert (victim.ids, victim.text) == ref_long, "the attacked stream differs from the undisturbed run"
    assert victim.resumes == 0
    c.wait_idle()
    print(
        f"\nFIGURES resume attacks: {len(attempts)} refused NOT_FOUND in {refused_s:.2f}s through the other "
        "frontend; the attacked stream completed token-identical on its own frontend"
    )


def test_a_killed_frontends_streams_resume_through_the_other_token_identical(fronts: Frontends) -> None:
    """It kills frontend fe0 for good (the test after it uses fe1 and a third frontend)."""
    c, addresses = fronts.cluster, fronts.addresses
    long_tokens, late_tokens = 300, 60
    jobs = [(prompt(100 + i), _kwargs(long_tokens, 9000 + i if i % 2 else None)) for i in range(6)]
    late_job = (prompt(120), _kwargs(late_tokens, None))
    # NOTE: with logprobs: its worker keeps them, so the catch-up resends them with its tokens
    logprobs_job = (prompt(150), {**_kwargs(long_tokens, None), "logprobs": 2})
    cancel_job = (prompt(130), _kwargs(long_tokens, None))
    sse_jobs = [(prompt(140 + i), _kwargs(long_tokens, 7000 + i if i else None)) for i in range(2)]
    # NOTE: an SSE completion with logprobs (greedy): the catch-up's logprobs come through the other frontend
    sse_jobs.append((prompt(142), {**_kwargs(long_tokens, None), "logprobs": 2}))
    *reference, late_ref, cancel_ref, sse_ref0, sse_ref1, sse_lp_ref, lp_ref = _reference(
        c, [*jobs, late_job, cancel_job, *sse_jobs, logprobs_job]
    )
    lp_ref_logprobs = _reference_logprobs(c, logprobs_job)
    sse_lp_ref_logprobs = _reference_logprobs(c, sse_jobs[2])
    c.wait_idle()

    readers = [Reader() for _ in jobs]
    for r, job in zip(readers[:3], jobs[:3], strict=True):
        threading.Thread(target=r.read_sync, args=(addresses, *job), daemon=True).start()
    with_logprobs = Reader()
    threading.Thread(target=with_logprobs.read_sync, args=(addresses, *logprobs_job), daemon=True).start()

    async def read_async() -> None:
        await asyncio.gather(*(r.read_async(addresses, *job) for r, job in zip(readers[3:], jobs[3:], strict=True)))

    threading.Thread(target=asyncio.run, args=(read_async(),), daemon=True).start()
    # NOTE: this one stops reading after its first tokens; its request runs on and ends while fe0 is dead
    late = Reader(hold=threading.Event())
    threading.Thread(target=late.read_sync, args=(addresses, *late_job), daemon=True).start()
    # NOTE: and this one is cancelled by its client after its resume (and after the late one finished): the new
    # owner must free its blocks
    cancelled = Reader(cancel_after_resume=150)
    threading.Thread(target=cancelled.read_sync, args=(addresses, *cancel_job), daemon=True).start()
    sse = [SseReader(fronts.http, {"prompt": p, **kw}) for p, kw in sse_jobs]
    for s in sse:
        threading.Thread(target=s.run, daemon=True).start()
    for r in [*readers, late, cancelled, *sse, with_logprobs]:
        assert r.started.wait(120) and r.error is None and r.ids, r.error
    at_kill_logprobs = len(with_logprobs.ids)
    at_kill = [len(r.ids) for r in [*readers, late]]
    t_kill = time.monotonic()
    fronts.procs[0].popen.kill()  # SIGKILL: every stream above is on fe0 (their first address)
    # the late request finishes on its worker (the others, 5x longer, still run): then its client reads on
    deadline = time.monotonic() + 120
    while c.status().router.requests_in_flight > len(readers) + 2 + len(sse):  # + cancelled, with_logprobs
        assert time.monotonic() < deadline, "the late request never finished on its worker"
        time.sleep(0.05)
    assert not any(r.done.is_set() for r in [*readers, cancelled]), "a long stream ended before the late one"
    late.hold.set()  # type: ignore[union-attr]
    for r in [*readers, late, cancelled, with_logprobs]:
        assert r.done.wait(TIMEOUT_S), "a stream hangs"
    for s, ref in zip(sse, [sse_ref0, sse_ref1, sse_lp_ref], strict=True):
        assert s.ended.wait(TIMEOUT_S), "an SSE stream hangs"
        assert s.error is None and s.done and s.finish == "length", (s.error, s.done, s.finish)
        assert (s.ids, s.text) == ref, "a resumed SSE stream differs from the undisturbed run"
        assert s.resumes == 1
    _check_sse_logprobs(sse[2], sse_lp_ref_logprobs, TokenText(load_tokenizer(c.model_dir)))
    gaps = []
    for r, ref, n in zip([*readers, late], [*reference, late_ref], at_kill, strict=True):
        assert r.error is None, r.error
        assert r.final is not None and r.final.finish_reason == "length", r.final
        assert r.ids == ref[0], "a resumed stream differs from the undisturbed run (a token lost or repeated)"
        assert r.text == ref[1], "a resumed stream's text differs from the undisturbed run"
        assert r.final.usage.completion_tokens == len(ref[0])
        assert n < len(ref[0]) and r.resumes == 1, (n, r.resumes)
        gaps.append(n)
    # With logprobs: resumed too, one logprobs entry per token across the cut (none lost or repeated), each the
    # greedy token's (its own logprob the largest) and equal to the undisturbed run's
    r = with_logprobs
    assert r.error is None and r.resumes == 1 and at_kill_logprobs < long_tokens, (r.error, r.resumes)
    assert (r.ids, r.text) == lp_ref and len(r.logprobs) == len(r.ids)
    assert all(max(lp, key=lp.__getitem__) == t for lp, t in zip(r.logprobs, r.ids, strict=True))
    assert [sorted(lp) for lp in r.logprobs] == [sorted(lp) for lp in lp_ref_logprobs]
    assert max(abs(a[k] - b[k]) for a, b in zip(r.logprobs, lp_ref_logprobs, strict=True) for k in a) < 1e-3
    assert isinstance(cancelled.error, grpc.RpcError) and cancelled.error.code() == grpc.StatusCode.CANCELLED
    assert 150 <= len(cancelled.ids) < long_tokens
    assert cancelled.ids == cancel_ref[0][: len(cancelled.ids)]
    c.wait_idle(timeout=60)  # NOTE: every block free on every worker (the cancelled one's too), integrity checked
    # the gap each (not held) stream saw: its first response after the kill less its last one before
    gap = max(min(t for t in r.times if t > t_kill) - max(t for t in r.times if t <= t_kill) for r in readers)
    print(
        f"\nFIGURES frontend SIGKILL under {len(readers) + 2} KVServeClient streams + {len(sse)} SSE (1 with "
        f"logprobs, resumed at token {sse[2].cuts[0][0]}; 3 sync, "
        f"3 async, 1 late reader, 1 cancelled after its resume; greedy and seeded): all resumed through the other "
        f"frontend token- and text-identical; tokens at the kill {gaps}; longest gap across the kill {gap:.2f}s; "
        f"all done {time.monotonic() - t_kill:.1f}s after the kill; blocks leaked 0"
    )




def test_a_stream_placed_before_a_router_restart_resumes_after_its_frontend_dies(fronts: Frontends) -> None:
    """After the test above (fe0 dead): streams through fe1 live through a router SIGKILL (the new router adopts
    them from the workers' tables, their resume grants included), then fe1 is SIGKILLed and their clients
    resume through a new frontend fe2, token- and text-identical."""
    c = fronts.cluster
    assert fronts.keys is not None
    fe2 = _frontend(c, "fe2", fronts.frontend_key, fronts.keys)
    try:
        addresses = [fronts.addresses[1], fe2.wait_for_line(FRONTEND_LINE, timeout=120).group(1)]
        jobs = [(prompt(150 + i), _kwargs(1500, 6000 + i if i % 2 else None)) for i in range(2)]
        reference = _reference(c, jobs)
        c.wait_idle()
        readers = [Reader() for _ in jobs]
        for r, job in zip(readers, jobs, strict=True):
            threading.Thread(target=r.read_sync, args=(addresses, *job), daemon=True).start()
        for r in readers:
            assert r.started.wait(120) and r.error is None and r.ids, r.error
        os.kill(c.router_pid(), signal.SIGKILL)
        c.proc.wait_for_dated_line(ROUTER_RESTARTED, timeout=240)
        deadline = time.monotonic() + 120  # NOTE: the new router adopted both (from the workers' tables)
        while c.status().router.requests_in_flight < len(jobs):
            assert time.monotonic() < deadline, "the restarted router never adopted the running requests"
            assert not any(r.done.is_set() for r in readers), "a stream ended before its frontend died"
            time.sleep(0.05)
        at_kill = [len(r.ids) for r in readers]
        fronts.procs[1].popen.kill()  # SIGKILL: both streams are on fe1 (their first address)
        for r in readers:
            assert r.done.wait(TIMEOUT_S), "a stream hangs"
        for r, ref, n in zip(readers, reference, at_kill, strict=True):
            assert r.error is None, r.error
            assert r.final is not None and r.final.finish_reason == "length", r.final
            assert (r.ids, r.text) == ref, "a resumed stream differs from the undisturbed run"
            assert n < len(ref[0]) and r.resumes == 1, (n, r.resumes)
        c.wait_idle(timeout=60)
        print(
            f"\nFIGURES router SIGKILL, then the owning frontend SIGKILL: {len(readers)} streams resumed through "
            f"a third frontend token- and text-identical (tokens at the frontend's kill {at_kill}); blocks leaked 0"
        )
    finally:
        if fe2.popen.poll() is None:
            fe2.kill_tree()
