"""Every Prometheus metric kvserve exports, defined once (names follow vLLM's, prefixed ``kvserve:``),
and ``RouterMetrics``, the one object through which a router writes them.

Per-worker gauges are set from each PressureReport (so a gauge equals the pool/scheduler state it
names as of the worker's last report), counters that workers keep as running totals are advanced
by what each report adds to the worker's previous one (``WorkerState.deltas``: the last totals are
the router's per-worker state, not this module's), and latency histograms are observed as tokens
arrive.
Each counter has one writer: preemptions are counted by the worker that preempts (the router's own
Preempt commands are counted apart, in ``router_preemption_commands``).
NOTE: the families stay module-level: prometheus_client registers a family once per registry, and
the ``/metrics`` endpoint serves the process's default one.
"""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import Counter, Gauge, Histogram, make_wsgi_app

from protos.kvserve.v1 import worker_pb2 as pb
from workers.core.sizes import pool_usage

_W = ["worker"]

KV_USAGE = Gauge("kvserve:kv_cache_usage_perc", "Fraction of KV blocks held by requests (0-1)", _W)
KV_BLOCKS_TOTAL = Gauge("kvserve:kv_blocks_total", "KV blocks in the worker's pool", _W)
KV_BLOCKS_FREE = Gauge("kvserve:kv_blocks_free", "KV blocks with no content", _W)
KV_BLOCKS_EVICTABLE = Gauge(
    "kvserve:kv_blocks_cached_evictable", "Unreferenced KV blocks kept for prefix reuse (LRU-evictable)", _W
)
KV_SWAP_USED = Gauge("kvserve:kv_swap_blocks_used", "Host swap-space blocks in use", _W)
RUNNING = Gauge("kvserve:num_requests_running", "Requests decoding on the worker", _W)
WAITING = Gauge("kvserve:num_requests_waiting", "Requests queued inside the worker", _W)
SWAPPED = Gauge("kvserve:num_requests_swapped", "Requests swapped out to host memory", _W)
WORKER_UP = Gauge("kvserve:worker_up", "1 if the worker is connected and healthy", _W)
REPORT_TIME = Gauge("kvserve:pressure_report_timestamp_seconds", "Unix time of the last pressure report", _W)
REPORT_AGE = Gauge("kvserve:pressure_report_age_seconds", "Seconds since the worker's last pressure report", _W)

ROUTER_QUEUE_REQUESTS = Gauge("kvserve:router_queue_requests", "Requests waiting in the router queue")
ROUTER_QUEUE_BLOCKS = Gauge("kvserve:router_queue_blocks", "KV blocks the router queue's requests need")
ROUTER_PROJECTED_WAIT = Gauge(
    "kvserve:router_projected_queue_wait_seconds",
    "Projected wait before a request joining the back of the router queue could start (NaN: no drain observed)",
)

PREEMPTIONS = Counter("kvserve:num_preemptions", "Preemptions by mode (counted by the workers)", ["mode"])
PREEMPT_COMMANDS = Counter(
    "kvserve:router_preemption_commands", "Preempt commands the router sent for a more important request", ["mode"]
)
MIGRATIONS = Counter("kvserve:num_migrations", "Requests migrated between workers")
REPLAYS = Counter("kvserve:num_failover_replays", "Requests continued on another worker after theirs died")
WORKER_RESTARTS = Counter("kvserve:worker_restarts", "Worker processes that came back as a new incarnation", _W)
REJECTIONS = Counter("kvserve:admission_rejections", "Requests refused at admission, by reason", ["reason"])
PREFIX_QUERIES = Counter("kvserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", _W)
PREFIX_HITS = Counter("kvserve:prefix_cache_hits", "Prompt tokens found in the prefix cache", _W)
PREFILL_TOKENS = Counter(
    "kvserve:prefill_tokens", "Tokens computed in prefill (prompt, recompute after preemption, replay)", _W
)
PROMPT_TOKENS = Counter("kvserve:prompt_tokens", "Prompt tokens of admitted requests")
GENERATION_TOKENS = Counter("kvserve:generation_tokens", "Tokens generated and streamed")

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TTFT = Histogram("kvserve:time_to_first_token_seconds", "Arrival to first token", buckets=_LATENCY_BUCKETS)
ITL = Histogram("kvserve:inter_token_latency_seconds", "Time between streamed tokens", buckets=_LATENCY_BUCKETS)
E2E = Histogram("kvserve:e2e_request_latency_seconds", "Arrival to final token", buckets=_LATENCY_BUCKETS)
QUEUE_TIME = Histogram("kvserve:request_queue_time_seconds", "Arrival to dispatch", buckets=_LATENCY_BUCKETS)

@dataclass(frozen=True)
class CounterDeltas:
    """What a worker counted since its previous report (PressureReport carries running totals)."""

    preemptions: int = 0
    swaps: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefill_tokens: int = 0


class RouterMetrics:
    """The router's one writer of metrics: each method is one thing that happened."""

    def observe_pressure(self, r: pb.PressureReport, counted: CounterDeltas) -> None:
        """A worker's report: gauges as it says, counters by what it ``counted`` since its last one."""
        w = r.worker_id
        KV_USAGE.labels(w).set(pool_usage(r.used_blocks, r.total_blocks))
        KV_BLOCKS_TOTAL.labels(w).set(r.total_blocks)
        KV_BLOCKS_FREE.labels(w).set(r.free_blocks)
        KV_BLOCKS_EVICTABLE.labels(w).set(r.cached_evictable_blocks)
        KV_SWAP_USED.labels(w).set(r.swap_blocks_total - r.swap_blocks_free)
        RUNNING.labels(w).set(r.num_running)
        WAITING.labels(w).set(r.num_waiting)
        SWAPPED.labels(w).set(r.num_swapped)
        REPORT_TIME.labels(w).set_to_current_time()
        PREEMPTIONS.labels("recompute").inc(counted.preemptions - counted.swaps)
        PREEMPTIONS.labels("swap").inc(counted.swaps)
        PREFIX_QUERIES.labels(w).inc(counted.prefix_query_tokens)
        PREFIX_HITS.labels(w).inc(counted.prefix_hit_tokens)
        PREFILL_TOKENS.labels(w).inc(counted.prefill_tokens)

    def worker_up(self, worker_id: str, up: bool) -> None:
        WORKER_UP.labels(worker_id).set(1 if up else 0)

    def worker_restarted(self, worker_id: str, times: int = 1) -> None:
        WORKER_RESTARTS.labels(worker_id).inc(times)

    def rejected(self, reason: str) -> None:
        REJECTIONS.labels(reason).inc()

    def admitted(self, prompt_tokens: int) -> None:
        PROMPT_TOKENS.inc(prompt_tokens)

    def dispatched(self, queue_time_s: float) -> None:
        QUEUE_TIME.observe(queue_time_s)

    def replayed(self) -> None:
        REPLAYS.inc()

    def migrated(self) -> None:
        MIGRATIONS.inc()

    def preempt_command(self, mode: str) -> None:
        PREEMPT_COMMANDS.labels(mode).inc()

    def streamed(self, ttft_s: float | None, itl_s: float | None, new_tokens: int, e2e_s: float | None) -> None:
        """One demuxed output of a request (router/demux.py ``Delivery``)."""
        if ttft_s is not None:
            TTFT.observe(ttft_s)
        if itl_s is not None:
            ITL.observe(itl_s)
        if new_tokens:
            GENERATION_TOKENS.inc(new_tokens)
        if e2e_s is not None:
            E2E.observe(e2e_s)


class _MetricsServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass


def start_metrics_server(port: int, addr: str = "127.0.0.1") -> WSGIServer:
    """Serve ``/metrics`` on ``addr:port`` (a daemon thread), always in the Prometheus text format.

    NOTE: prometheus_client >= 0.22 writes OpenMetrics sample names with ':' turned into '_' while
    their ``# TYPE`` lines keep it (prometheus/client_python#1177). Prometheus asks for OpenMetrics
    first, so it would store ``kvserve_*`` instead of the ``kvserve:*`` names every alert and panel
    uses. The text format (what a scraper gets without an Accept header) keeps the names as defined.
    """
    app = make_wsgi_app()

    def text_format(environ: dict, start_response):  # noqa: ANN202 - WSGI
        environ.pop("HTTP_ACCEPT", None)
        return app(environ, start_response)

    server_class = type("MetricsServer", (_MetricsServer,), {"address_family": socket.AF_INET6 if ":" in addr
                                                              else socket.AF_INET})  # fmt: skip
    httpd = make_server(addr, port, text_format, server_class, handler_class=_QuietHandler)
    threading.Thread(target=httpd.serve_forever, name="kvserve-metrics", daemon=True).start()
    return httpd
