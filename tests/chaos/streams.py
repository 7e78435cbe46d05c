"""Client-side helpers for the chaos tests: streams read on threads that record what they saw
(tokens, the workers that produced them, the final message or the error and its trailers), with
events to synchronise on instead of sleeps, and the router's RSS sampled through psutil."""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field

import grpc
import psutil

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.protos.kvserve.v1 import serving_pb2_grpc


def request(
    prompt: list[int], max_tokens: int, *, seed: int | None = None, request_id: str = ""
) -> spb.GenerateRequest:
    """A token-id request that runs to max_tokens: greedy, or sampled (temperature 0.8) with ``seed``."""
    sampling = spb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    if seed is not None:
        sampling.temperature = 0.8
        sampling.seed = seed
    return spb.GenerateRequest(request_id=request_id, token_ids=spb.TokenIds(ids=prompt), sampling=sampling)


def prompt(i: int, n: int = 16) -> list[int]:
    """A distinct prompt per ``i`` (token ids inside the tiny model's vocabulary)."""
    return [(7 * i + 13 * k + 5) % 900 + 3 for k in range(n)]


@dataclass
class Stream:
    """One Generate call read to its end on a thread."""

    address: str
    req: spb.GenerateRequest
    timeout: float = 180.0
    first_tokens: int = 3  # ``started`` is set once this many tokens arrived
    metadata: tuple[tuple[str, str], ...] = ()  # e.g. the bearer token of a cluster with --auth-token
    # A channel to call on (kept open: e.g. one connection known to reach one frontend behind a
    # shared port); None: a channel of its own.
    channel: grpc.Channel | None = None
    tokens: list[int] = field(default_factory=list)
    worker_ids: list[str] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # monotonic arrival of each response
    final: spb.GenerateResponse | None = None
    code: grpc.StatusCode | None = None
    details: str = ""
    trailers: dict[str, str] = field(default_factory=dict)
    ended_at: float | None = None
    started: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)

    def start(self) -> Stream:
        threading.Thread(target=self._run, daemon=True).start()
        return self

    def _run(self) -> None:
        try:
            with contextlib.nullcontext(self.channel) if self.channel else grpc.insecure_channel(self.address) as ch:
                for resp in serving_pb2_grpc.KVServeStub(ch).Generate(
                    self.req, timeout=self.timeout, metadata=self.metadata
                ):
                    self.tokens.extend(resp.token_ids)
                    self.worker_ids.append(resp.worker_id)
                    self.times.append(time.monotonic())
                    if len(self.tokens) >= self.first_tokens:
                        self.started.set()
                    if resp.finish_reason:
                        self.final = resp
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            self.code, self.details = e.code(), e.details() or ""
            self.trailers = {k: v for k, v in (e.trailing_metadata() or ())}
        finally:
            self.ended_at = time.monotonic()
            self.started.set()
            self.done.set()

    def wait(self, timeout: float) -> Stream:
        assert self.done.wait(timeout), f"{self.req.request_id!r} not done in {timeout}s: {len(self.tokens)} tokens"
        return self

    @property
    def last_worker(self) -> str:
        return self.worker_ids[-1] if self.worker_ids else ""

    def resumed_after(self, t: float, away_from: str) -> float | None:
        """Seconds from ``t`` to this stream's first response from a worker other than
        ``away_from`` (None if there is none)."""
        for at, worker_id in zip(self.times, self.worker_ids, strict=True):
            if at >= t and worker_id and worker_id != away_from:
                return at - t
        return None


def run_all(address: str, reqs: list[spb.GenerateRequest], timeout: float = 180.0) -> list[Stream]:
    streams = [Stream(address, r, timeout).start() for r in reqs]
    for s in streams:
        s.wait(timeout + 30)
    return streams


def rss_bytes(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


class RssSampler:
    """Samples a process's RSS on a thread (every ``interval_s``) while in a ``with`` block; ``peak``."""

    def __init__(self, pid: int, interval_s: float = 0.1) -> None:
        self.process, self.interval_s = psutil.Process(pid), interval_s
        self.before = self.peak = self.process.memory_info().rss
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, self.process.memory_info().rss)
            self.samples += 1

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.after = self.process.memory_info().rss
        self.peak = max(self.peak, self.after)
