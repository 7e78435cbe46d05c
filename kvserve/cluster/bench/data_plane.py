"""`kvserve bench data-plane`: how many streamed tokens the serving path carries, and what each costs
the router, with simulated workers (kvserve/cluster/bench/sim_worker.py: the real WorkerLink, tokens on a
clock, no model).

It starts a local Ray, the real router actor and ``--workers`` simulated workers, then runs
``--streams`` concurrent client streams through the real client API (gRPC ``Generate`` or the HTTP API's
SSE ``/v1/completions``), each for ``--max-tokens`` tokens, and reports:

* ``streamed_tokens_per_s``: tokens the clients received over the window from the first request sent
  to the last stream finished;
* ``router_cpu_us_per_token``: the router process's CPU time (user + system, from ``/proc``) over that
  window, divided by the tokens streamed (it includes each request's admission, placement and Ray
  dispatch);
* ``router_cpu_us_per_token_steady``: the same over the steady part of the run only, from the moment
  every stream has its first token to the first stream's end (sampled every 50 ms; NaN when the run
  has no such part, e.g. a stream ends before the last one starts): what streaming alone costs,
  without the per-request work at the start and the end;
* ``added_itl_p50_ms`` / ``added_itl_p99_ms``: per step message after a stream's first response, arrival
  at the client minus the worker's emission time (carried in ``text_delta``; one clock on one machine), i.e.
  the latency the serving path adds to each token after the first;
* ``added_first_p50_ms`` / ``added_first_p99_ms``: the same for each stream's first response (the serving
  path's part of time to first token). NOTE: kept apart from ITL, as vLLM's and guidellm's ITL leave out the
  first token: a first response also pays one-time costs (a worker's first output to a frontend dials that
  frontend's data link), 5-18 ms on a shared 2-core box, which made a 4-stream run's "ITL" p99 14 ms
  against 2.5 ms for every later token;
* ``router_rss_mb``: the router's resident memory at the end.

``--frontends N`` puts N stateless frontends (frontend/, the same Ray actors ``kvserve serve --frontends``
starts) between the clients and the router: the clients call the frontends' shared ports, each
frontend relays over one GenerateStream, and ``frontend_cpu_us_per_token`` is their CPU time (all
of them) per streamed token; ``router_cpu_us_per_token`` stays the router process's alone.

``--protocol grpc-mux`` sends every stream over one ``GenerateStream`` (kvserve/router/requests/mux.py): the router then
sends one message per worker step for all of them and the client unbatches by request id.

``--sim realistic`` (issue 41 item 6): the simulated workers also send what real ones do besides the
tokens (kvserve/cluster/bench/sim_worker.py ``SimSpec.realistic``: every prompt block stored and, from a
``--sim-blocks`` pool, evicted; reports with the pool's and prefix cache's counters), and every stream has
a prompt of its own (16 to 256 tokens, as the ``tiny`` workload): the router's per-request and
per-block work is then the real one. ``plain`` (the default) keeps one 16-token prompt and tokens only.

A sweep is a list of values for ``--streams`` / ``--workers`` / ``--tokens-per-step`` (every
combination); the clients run in this process, so on a small machine they compete with the router for
cores: the per-token CPU figure is the router's own either way.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvserve.cluster.bench.proc_cpu import CpuReading, read_cpu

if TYPE_CHECKING:
    from kvserve.router.config import RouterConfig

_PROMPT = list(range(1, 17))


def stream_prompts(streams: int, realistic: bool) -> list[list[int]]:
    """Each stream's prompt: the one short prompt, or (``realistic``) a distinct one of 16 to 256 tokens."""
    if not realistic:
        return [_PROMPT] * streams
    return [[(i * 7919 + k * 31) % 30000 + 1 for k in range(16 + (i * 37) % 241)] for i in range(streams)]


@dataclass(frozen=True)
class PlanePoint:
    """One setting of the sweep and what it measured."""

    sim: str
    workers: int
    frontends: int
    streams: int
    tokens_per_step: int
    step_ms: float
    protocol: str
    streamed_tokens: int
    window_s: float
    streamed_tokens_per_s: float
    router_cpu_s: float
    router_cpu_us_per_token: float
    router_cpu_us_per_token_steady: float
    frontend_cpu_us_per_token: float
    added_itl_p50_ms: float
    added_itl_p99_ms: float
    added_first_p50_ms: float
    added_first_p99_ms: float
    router_rss_mb: float
    failed_streams: int


@dataclass
class _Meter:
    """What the clients have received so far, with (tokens, router CPU) sampled every ``period_s`` while
    every stream runs. NOTE: sampled from ``received`` itself, not from a task: a client loop busy
    with arriving messages would starve a sampling task exactly when the rate is highest."""

    streams: int
    router_pid: int | None = None  # None: no sampling (tests)
    period_s: float = 0.05
    tokens: int = 0
    started: int = 0  # streams that got their first token
    ended: int = 0
    samples: list[tuple[int, CpuReading]] = field(default_factory=list)  # (tokens, router CPU), steady only
    _next_sample: float = 0.0

    def received(self, before: int, new_tokens: int, final: bool) -> None:
        """A stream that had ``before`` tokens got ``new_tokens`` more (``final``: its last message)."""
        self.tokens += new_tokens
        self.started += before == 0 and new_tokens > 0
        self.ended += final
        if self.router_pid is not None and self.steady() and (now := time.monotonic()) >= self._next_sample:
            self._next_sample = now + self.period_s
            self.samples.append((self.tokens, read_cpu(self.router_pid)))

    def steady(self) -> bool:
        """Every stream runs: all started, none ended."""
        return self.started == self.streams and not self.ended

    def steady_us_per_token(self) -> float:
        if len(self.samples) < 2 or self.samples[-1][0] == self.samples[0][0]:
            return float("nan")
        (t0, c0), (t1, c1) = self.samples[0], self.samples[-1]
        return c1.seconds_since(c0) / (t1 - t0) * 1e6


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) by nearest rank; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def stamps_latency_ms(text: str, arrival_ns: int) -> list[float]:
    """Added latency of each step carried in one response's ``text`` (``"<ns>;<ns>;"``), in ms."""
    return [(arrival_ns - int(s)) / 1e6 for s in text.split(";") if s]


@dataclass
class AddedLatency:
    """The added latencies of the streams' step messages: their first responses' apart from the rest (ITL)."""

    first: list[float] = field(default_factory=list)
    later: list[float] = field(default_factory=list)

    def add(self, text: str, arrival_ns: int, first: bool) -> None:
        """A response with stamps ``text`` arrived; ``first``: its stream had no token before it."""
        (self.first if first else self.later).extend(stamps_latency_ms(text, arrival_ns))


async def _grpc_stream(stub: Any, prompt: list[int], max_tokens: int, lat: AddedLatency, meter: _Meter) -> int:
    from kvserve.protos.kvserve.v1 import serving_pb2 as spb

    request = spb.GenerateRequest(
        token_ids=spb.TokenIds(ids=prompt), sampling=spb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    )
    tokens = 0
    async for resp in stub.Generate(request, timeout=600):
        lat.add(resp.text_delta, time.monotonic_ns(), tokens == 0)
        meter.received(tokens, len(resp.token_ids), bool(resp.finish_reason))
        tokens += len(resp.token_ids)
    return tokens


async def _grpc_mux(
    stub: Any, prompts: list[list[int]], max_tokens: int, lat: AddedLatency, meter: _Meter
) -> list[int | BaseException]:
    """Every request on one ``GenerateStream``, unbatched here by request id."""
    from kvserve.protos.kvserve.v1 import serving_pb2 as spb
    from kvserve.router.requests.mux import column_entries

    sampling = spb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    tokens = dict.fromkeys((f"r{i}" for i in range(len(prompts))), 0)

    async def requests():  # noqa: ANN202 - an async generator of messages
        for rid, prompt in zip(tokens, prompts, strict=True):  # NOTE: token_columns, as a frontend asks
            request = spb.GenerateRequest(request_id=rid, token_ids=spb.TokenIds(ids=prompt), sampling=sampling)
            yield spb.GenerateStreamRequest(generate=request, token_columns=True)

    failed: dict[str, BaseException] = {}
    async for batch in stub.GenerateStream(requests(), timeout=600):
        now = time.monotonic_ns()
        for rid, new, text, _ in column_entries(batch.columns):
            lat.add(text, now, tokens[rid] == 0)
            meter.received(tokens[rid], len(new), False)
            tokens[rid] += len(new)
        for resp in batch.responses:
            lat.add(resp.text_delta, now, tokens[resp.request_id] == 0)
            meter.received(tokens[resp.request_id], len(resp.token_ids), bool(resp.finish_reason))
            tokens[resp.request_id] += len(resp.token_ids)
        for err in batch.errors:
            failed[err.request_id] = RuntimeError(f"{err.request_id}: code {err.code}: {err.message}")
    return [failed.get(rid, n) for rid, n in tokens.items()]


async def _http_stream(
    http: Any, url: str, prompt: list[int], max_tokens: int, lat: AddedLatency, meter: _Meter
) -> int:
    body = {"model": "sim", "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    tokens = 0
    async with http.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", ()):
                lat.add(choice.get("text", ""), time.monotonic_ns(), tokens == 0)
                n = len(choice.get("token_ids") or ())
                meter.received(tokens, n, bool(choice.get("finish_reason")))
                tokens += n
    return tokens


async def _drive(
    address: str, http_url: str | None, prompts: list[list[int]], max_tokens: int, mux: bool, router_pid: int
) -> tuple[int, float, AddedLatency, int, float]:
    """Run ``streams`` concurrent streams; (tokens, window seconds, added latencies, failed streams,
    steady router CPU µs per token)."""
    import grpc
    import httpx

    from kvserve.protos.kvserve.v1 import serving_pb2_grpc

    lat = AddedLatency()
    streams = len(prompts)
    meter = _Meter(streams, router_pid)
    t0 = time.monotonic()
    if http_url is None:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = serving_pb2_grpc.KVServeStub(channel)
            if mux:
                results = await _grpc_mux(stub, prompts, max_tokens, lat, meter)
            else:
                results = await asyncio.gather(*(_grpc_stream(stub, p, max_tokens, lat, meter) for p in prompts),
                                               return_exceptions=True)  # fmt: skip
    else:
        limits = httpx.Limits(max_connections=streams, max_keepalive_connections=streams)
        async with httpx.AsyncClient(timeout=600, limits=limits) as http:
            results = await asyncio.gather(
                *(_http_stream(http, http_url, p, max_tokens, lat, meter) for p in prompts), return_exceptions=True
            )
    window = time.monotonic() - t0
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        print(f"data-plane: {len(failed)} of {streams} streams failed, first: {failed[0]!r}", file=sys.stderr)
    return sum(r for r in results if isinstance(r, int)), window, lat, len(failed), meter.steady_us_per_token()


def bench_router_config(streams: int) -> RouterConfig:
    """The router's config for ``streams`` streams from one client: none refused or cut off by the bounds
    that protect a real server (queue length, unread responses, streams per client)."""
    from kvserve.router.config import RouterConfig

    return RouterConfig(port=0, max_queue_requests=max(1024, streams), max_buffered_responses=1 << 16,
                        max_streams_per_client=max(RouterConfig().max_streams_per_client, streams))  # fmt: skip


def measure(workers: int, streams: int, tokens_per_step: int, step_ms: float, max_tokens: int,
            protocol: str, frontends: int = 0, py_spy: str | None = None, sim: str = "plain",
            sim_blocks: int = 1 << 16) -> PlanePoint:  # fmt: skip
    """One point: a fresh router and simulated workers (and ``frontends``), ``streams`` streams through them.

    ``py_spy``: record the router process with py-spy during the streams (collapsed stacks into this file).
    ``sim``: "plain" or "realistic" simulated workers (module doc), the latter with ``sim_blocks`` blocks."""
    import psutil
    import ray

    from kvserve.cluster.bench.sim_worker import SimSpec, sim_worker_actor_class
    from kvserve.cluster.frontends import start_frontends, stop_frontends
    from kvserve.cluster.launch import _register_workers, _start_router, worker_options_for
    from kvserve.workers.core.worker_credential import new_worker_key
    from kvserve.workers.transport.options import WorkerOptions

    config = bench_router_config(streams)
    key = new_worker_key()
    fkey = new_worker_key() if frontends else None
    http = 0 if protocol == "http" else None
    router, http_port = _start_router(config, None, None, None if frontends else http, key, fkey)
    handles: dict[str, Any] = {}
    fronts: list[Any] = []
    try:
        address = ray.get(router.address.remote())
        realistic = sim == "realistic"
        spec = SimSpec(step_ms=step_ms, tokens_per_step=tokens_per_step, realistic=realistic,
                       total_blocks=sim_blocks if realistic else SimSpec.total_blocks)  # fmt: skip
        actor = sim_worker_actor_class()
        ids = [f"worker-{i}" for i in range(workers)]
        ray.get(router.expect_workers.remote(ids))
        handles = {w: actor.remote(w, worker_options_for(WorkerOptions(), w, key, address, frontend_key=fkey), spec)
                   for w in ids}  # fmt: skip
        _register_workers(router, handles, 60.0)
        client_address = address
        if frontends:
            fronts, grpc_port, http_port = start_frontends(frontends, config, address, 0, http, fkey or "")
            client_address = f"127.0.0.1:{grpc_port}"
        front_pids = [ray.get(f.pid.remote()) for f in fronts]
        pid = ray.get(router.pid.remote())
        http_url = f"http://127.0.0.1:{http_port}/v1/completions" if protocol == "http" else None
        cpu0, fcpu0 = read_cpu(pid), [read_cpu(p) for p in front_pids]
        mux = protocol == "grpc-mux"
        spy = _py_spy(pid, py_spy) if py_spy else None
        try:
            tokens, window, lat, failed, steady = asyncio.run(
                _drive(client_address, http_url, stream_prompts(streams, realistic), max_tokens, mux, pid)
            )
        finally:
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                spy.wait(timeout=60)
        cpu = read_cpu(pid).seconds_since(cpu0)
        fcpu = sum(read_cpu(p).seconds_since(c0) for p, c0 in zip(front_pids, fcpu0, strict=True))
        rss = psutil.Process(pid).memory_info().rss / 2**20
    finally:
        stop_frontends(fronts)
        for h in handles.values():
            ray.kill(h)
        ray.kill(router)
    per_token = (lambda s: s / tokens * 1e6) if tokens else (lambda s: float("nan"))
    return PlanePoint(
        sim, workers, frontends, streams, tokens_per_step, step_ms, protocol, tokens, window,
        tokens / window if window else 0.0, cpu, per_token(cpu), steady, per_token(fcpu) if frontends else 0.0,
        percentile(lat.later, 0.5), percentile(lat.later, 0.99), percentile(lat.first, 0.5),
        percentile(lat.first, 0.99), rss, failed,
    )  # fmt: skip


def _py_spy(pid: int, out: str) -> subprocess.Popen:
    """``py-spy record`` of ``pid`` into ``out`` until SIGINT (py-spy sits beside this interpreter)."""
    exe = str(Path(sys.executable).with_name("py-spy"))
    cmd = [exe, "record", "--pid", str(pid), "--format", "raw", "--threads", "--nonblocking", "--rate", "200",
           "-o", out]  # fmt: skip
    spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    time.sleep(1.0)  # NOTE: let py-spy attach before the streams start
    return spy


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=_ints, default=[2], help="simulated workers (a comma list sweeps)")
    p.add_argument("--streams", type=_ints, default=[64], help="concurrent client streams (a comma list sweeps)")
    p.add_argument("--tokens-per-step", type=_ints, default=[1], help="tokens each stream gets per worker step")
    p.add_argument("--step-ms", type=float, default=20.0, help="the simulated workers' step time")
    p.add_argument("--max-tokens", type=int, default=200, help="tokens per stream")
    p.add_argument("--protocol", choices=("grpc", "grpc-mux", "http"), default="grpc",
                   help="the client API: a gRPC Generate per stream, every stream on one GenerateStream (one "
                        "message per worker step, unbatched by the client), or HTTP/SSE")  # fmt: skip
    p.add_argument("--frontends", type=_ints, default=[0],
                   help="stateless frontends between clients and router (a comma list sweeps; 0 = none)")  # fmt: skip
    p.add_argument("--sim", choices=("plain", "realistic"), default="plain",
                   help="simulated workers sending tokens only, or also a real worker's block events, pool and "
                        "prefix-cache reports, with a prompt per stream (module doc)")  # fmt: skip
    p.add_argument("--sim-blocks", type=int, default=4096, help="--sim realistic: each simulated worker's pool")
    p.add_argument("--json", action="store_true", help="one JSON object per point instead of the table")
    p.add_argument("--py-spy", metavar="OUT", help="record the router with py-spy while the streams run "
                   "(collapsed stacks; one file per point: OUT.<index>)")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    import logging

    from kvserve.cluster.launch import init_ray

    logging.getLogger("httpx").setLevel(logging.WARNING)  # NOTE: one INFO line per stream otherwise

    owns_ray = init_ray(None)
    points = []
    try:
        for f, w, s, k in itertools.product(args.frontends, args.workers, args.streams, args.tokens_per_step):
            spy_out = f"{args.py_spy}.{len(points)}" if args.py_spy else None
            point = measure(w, s, k, args.step_ms, args.max_tokens, args.protocol, f, spy_out, args.sim,
                            args.sim_blocks)  # fmt: skip
            points.append(point)
            if args.json:
                print(json.dumps(asdict(point)), flush=True)
    finally:
        if owns_ray:
            import ray

            ray.shutdown()
    if not args.json:
        print(format_table(points))
    return 1 if any(p.failed_streams for p in points) else 0


def format_table(points: list[PlanePoint]) -> str:
    head = ("| sim | proto | frontends | workers | streams | tok/step | step ms | streamed tok/s | router CPU µs/tok "
            "(steady) | frontends CPU µs/tok | added ITL p50 / p99 ms | added first-token p50 / p99 ms | router RSS MB "
            "| failed streams |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    rows = [
        f"| {p.sim} | {p.protocol} | {p.frontends} | {p.workers} | {p.streams} | {p.tokens_per_step} | {p.step_ms:g} | "
        f"{p.streamed_tokens_per_s:,.0f} | {p.router_cpu_us_per_token:.1f} ({p.router_cpu_us_per_token_steady:.1f}) | "
        f"{p.frontend_cpu_us_per_token:.1f} | {p.added_itl_p50_ms:.1f} / {p.added_itl_p99_ms:.1f} | "
        f"{p.added_first_p50_ms:.1f} / {p.added_first_p99_ms:.1f} | "
        f"{p.router_rss_mb:.0f} | {p.failed_streams} |"
        for p in points
    ]
    return "\n".join([head, *rows])
