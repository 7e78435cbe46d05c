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
from collections.abc import Callable, Mapping
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import Counter, Gauge, Histogram, make_wsgi_app

from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.router.observe.loop_metrics import LoopCounter, LoopHistogram
from kvserve.workers.core.sizes import pool_usage

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
TIER_HITS = Counter("kvserve:prefix_cache_tier_hits", "Prompt tokens loaded from a host or disk tier", [*_W, "tier"])
TIER_BYTES = Counter(
    "kvserve:tier_bytes", "KV bytes a worker spilled to (written) or loaded from (loaded) the tiers", [*_W, "direction"]
)
TIER_LOAD_SECONDS = Counter("kvserve:tier_load_seconds", "Time spent loading blocks from the tiers", _W)
TIER_SPILLS_DROPPED = Counter("kvserve:tier_spills_dropped", "Evicted blocks not spilled (writer behind)", _W)
# NOTE: a node's tiers are shared by its workers, and each reports the same usage: one series per node
# (not per worker), so that a sum over nodes counts each tier once.
TIER_BYTES_USED = Gauge("kvserve:tier_cache_bytes_used", "Bytes in a node's tier", ["node", "tier"])
TIER_BYTES_CAPACITY = Gauge("kvserve:tier_cache_bytes_capacity", "Budget of a node's tier", ["node", "tier"])
TIER_LOAD_RATIO = Gauge(
    "kvserve:tier_load_recompute_ratio", "Measured load / recompute time of one block (0 = unmeasured)", [*_W, "tier"]
)
RECOMPUTE_MS = Gauge("kvserve:recompute_ms_per_block", "Measured prefill time of one KV block", _W)
PROMPT_TOKENS = Counter("kvserve:prompt_tokens", "Prompt tokens of admitted requests")
# NOTE: written per streamed token, by the router's loop alone: lock-free families (router/observe/loop_metrics.py)
GENERATION_TOKENS = LoopCounter("kvserve:generation_tokens", "Tokens generated and streamed")

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TTFT = LoopHistogram("kvserve:time_to_first_token_seconds", "Arrival to first token", _LATENCY_BUCKETS)
ITL = LoopHistogram("kvserve:inter_token_latency_seconds", "Time between streamed tokens", _LATENCY_BUCKETS)
E2E = LoopHistogram("kvserve:e2e_request_latency_seconds", "Arrival to final token", _LATENCY_BUCKETS)
QUEUE_TIME = Histogram("kvserve:request_queue_time_seconds", "Arrival to dispatch", buckets=_LATENCY_BUCKETS)
LOOP_LAG = Histogram(
    "kvserve:router_event_loop_lag_seconds",
    "How late the router's event loop woke a 50 ms timer (observe/loop_lag.py): a blocked loop stalls every stream",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)
LOOP_HELD = Histogram(
    "kvserve:router_event_loop_held_seconds",
    "The loop's lag less its thread's wait for a CPU (router/observe/loop_lag.py): how long the router itself held it",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)

GC_PAUSE = Histogram(
    "kvserve:router_gc_pause_seconds",
    "Garbage-collector pauses of the router process by generation (kvserve/workers/core/gc_pauses.py)",
    ["generation"],
    buckets=(0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
)

GC_FROZEN = Gauge(
    "kvserve:router_gc_frozen_objects", "Start-up objects the router froze out of garbage collection (0: not frozen)"
)


# The OpenAI-compatible HTTP API's (kvserve/router/api/http_api.py, in the router or a frontend). ``route`` is
# the route template (a fixed set, ``other`` for anything else): bounded cardinality whatever clients send.
HTTP_REQUESTS = Counter("kvserve:http_requests", "HTTP API requests by route and status code", ["route", "status"])
HTTP_DURATION = Histogram(
    "kvserve:http_request_duration_seconds",
    "HTTP API request time, first byte in to last byte out (streams: the whole stream)",
    ["route"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)


# What a worker counted since its previous report: each ``*_total`` field of PressureReport by name
# (``WorkerState.deltas``), so a new counter needs no code here beyond the line that exports it.
CounterDeltas = Mapping[str, int]


class _WorkerSeries:
    """One worker's labelled series of the per-report metrics, looked up once: a report arrives per
    worker step, and ``labels()`` costs more than the ``set`` it precedes."""

    def __init__(self, w: str) -> None:
        self.kv_usage, self.total, self.free = KV_USAGE.labels(w), KV_BLOCKS_TOTAL.labels(w), KV_BLOCKS_FREE.labels(w)
        self.evictable, self.swap_used = KV_BLOCKS_EVICTABLE.labels(w), KV_SWAP_USED.labels(w)
        self.running, self.waiting, self.swapped = RUNNING.labels(w), WAITING.labels(w), SWAPPED.labels(w)
        self.report_time = REPORT_TIME.labels(w)
        self.prefix_queries, self.prefix_hits = PREFIX_QUERIES.labels(w), PREFIX_HITS.labels(w)
        self.prefill_tokens = PREFILL_TOKENS.labels(w)


class RouterMetrics:
    """The router's one writer of metrics: each method is one thing that happened."""

    def __init__(self) -> None:
        self._series: dict[str, _WorkerSeries] = {}
        self._recomputes, self._swaps = PREEMPTIONS.labels("recompute"), PREEMPTIONS.labels("swap")

    # ---- the router process's own gauges (read at scrape time) -----------------------------------------
    @staticmethod
    def watch_queue(requests: Callable[[], float], blocks: Callable[[], float], wait_s: Callable[[], float]) -> None:
        """The admission queue's depth in requests and blocks and its projected wait, read at each scrape."""
        ROUTER_QUEUE_REQUESTS.set_function(requests)
        ROUTER_QUEUE_BLOCKS.set_function(blocks)
        ROUTER_PROJECTED_WAIT.set_function(wait_s)

    @staticmethod
    def watch_report_age(worker_id: str, age_s: Callable[[], float]) -> None:
        """Seconds since ``worker_id``'s last pressure report (NaN before its first), read at each scrape."""
        REPORT_AGE.labels(worker_id).set_function(age_s)

    @staticmethod
    def loop_lag_sinks() -> tuple[Callable[[float], None], Callable[[float], None]]:
        """Where the loop-lag watcher (kvserve/router/observe/loop_lag.py) puts its lag and held samples."""
        return LOOP_LAG.observe, LOOP_HELD.observe

    @staticmethod
    def gc_paused(generation: int, seconds: float) -> None:
        """A garbage collection of ``generation`` held the router process for ``seconds``
        (kvserve/workers/core/gc_pauses.py calls it)."""
        GC_PAUSE.labels(str(generation)).observe(seconds)

    @staticmethod
    def heap_settled(frozen_objects: int) -> None:
        """The start-up heap was frozen (``frozen_objects``) out of the collector's scans."""
        GC_FROZEN.set(frozen_objects)

    def observe_pressure(self, r: pb.PressureReport, counted: CounterDeltas, node: str = "") -> None:
        """A worker's report: gauges as it says, counters by what it ``counted`` since its last one.
        ``node``: the node the worker runs on (its tiers' usage is the node's)."""
        w = r.worker_id
        m = self._series.get(w)
        if m is None:
            m = self._series[w] = _WorkerSeries(w)
        m.kv_usage.set(pool_usage(r.used_blocks, r.total_blocks))
        m.total.set(r.total_blocks)
        m.free.set(r.free_blocks)
        m.evictable.set(r.cached_evictable_blocks)
        m.swap_used.set(r.swap_blocks_total - r.swap_blocks_free)
        m.running.set(r.num_running)
        m.waiting.set(r.num_waiting)
        m.swapped.set(r.num_swapped)
        m.report_time.set_to_current_time()
        swaps = counted["num_swaps_total"]
        self._recomputes.inc(counted["num_preemptions_total"] - swaps)
        self._swaps.inc(swaps)
        m.prefix_queries.inc(counted["prefix_cache_query_tokens_total"])
        m.prefix_hits.inc(counted["prefix_cache_hit_tokens_total"])
        m.prefill_tokens.inc(counted["prefill_tokens_total"])
        if r.host_cache_bytes_capacity or r.disk_cache_bytes_capacity:  # a worker with tiers (docs/architecture.md §3a)
            self._observe_tiers(r, counted, node)

    @staticmethod
    def _observe_tiers(r: pb.PressureReport, counted: CounterDeltas, node: str) -> None:
        w = r.worker_id
        TIER_HITS.labels(w, "host").inc(counted["prefix_cache_host_hit_tokens_total"])
        TIER_HITS.labels(w, "disk").inc(counted["prefix_cache_disk_hit_tokens_total"])
        TIER_BYTES.labels(w, "written").inc(counted["tier_bytes_written_total"])
        TIER_BYTES.labels(w, "loaded").inc(counted["tier_bytes_loaded_total"])
        TIER_LOAD_SECONDS.labels(w).inc(counted["tier_load_seconds_total"])
        TIER_SPILLS_DROPPED.labels(w).inc(counted["tier_spills_dropped_total"])
        tiers = (("host", r.host_cache_bytes_used, r.host_cache_bytes_capacity, r.host_load_ratio),
                 ("disk", r.disk_cache_bytes_used, r.disk_cache_bytes_capacity, r.disk_load_ratio))  # fmt: skip
        for tier, used, capacity, ratio in tiers:
            if capacity:
                TIER_BYTES_USED.labels(node, tier).set(used)
                TIER_BYTES_CAPACITY.labels(node, tier).set(capacity)
                TIER_LOAD_RATIO.labels(w, tier).set(ratio)
        RECOMPUTE_MS.labels(w).set(r.recompute_ms_per_block)

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

    def streamed_plain(self, inter_token_s: list[float], new_tokens: int) -> None:
        """A step's plain outputs delivered on the fast path (kvserve/router/requests/router.py ``_on_columns``): one
        inter-token gap per output, and the tokens they added."""
        for itl in inter_token_s:
            ITL.observe(itl)
        if new_tokens:
            GENERATION_TOKENS.inc(new_tokens)

    def streamed(self, ttft_s: float | None, itl_s: float | None, new_tokens: int, e2e_s: float | None) -> None:
        """One demuxed output of a request (kvserve/router/requests/demux.py ``Delivery``)."""
        if ttft_s is not None:
            TTFT.observe(ttft_s)
        if itl_s is not None:
            ITL.observe(itl_s)
        if new_tokens:
            GENERATION_TOKENS.inc(new_tokens)
        if e2e_s is not None:
            E2E.observe(e2e_s)

    # ---- the HTTP API (kvserve/router/api/http_middleware.py ``MetricsMiddleware``) ------------------------
    @staticmethod
    def http_request(route: str, status: str, seconds: float) -> None:
        """An HTTP API request to ``route`` (a template) ended with ``status`` after ``seconds``."""
        HTTP_REQUESTS.labels(route, status).inc()
        HTTP_DURATION.labels(route).observe(seconds)


class _MetricsServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass


def start_metrics_server(
    port: int, addr: str = "127.0.0.1", authorized: Callable[[str], bool] | None = None
) -> WSGIServer:
    """Serve ``/metrics`` on ``addr:port`` (a daemon thread), always in the Prometheus text format.

    ``authorized``: when given, a scrape whose ``Authorization`` header it refuses gets 401
    (``router.metrics_auth``: the client API's token or API keys).

    NOTE: prometheus_client >= 0.22 writes OpenMetrics sample names with ':' turned into '_' while
    their ``# TYPE`` lines keep it (prometheus/client_python#1177). Prometheus asks for OpenMetrics
    first, so it would store ``kvserve_*`` instead of the ``kvserve:*`` names every alert and panel
    uses. The text format (what a scraper gets without an Accept header) keeps the names as defined.
    """
    app = make_wsgi_app()

    def text_format(environ: dict, start_response):  # noqa: ANN202 - WSGI
        if authorized is not None and not authorized(environ.get("HTTP_AUTHORIZATION", "")):
            start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
            return [b"missing or wrong bearer token\n"]
        environ.pop("HTTP_ACCEPT", None)
        return app(environ, start_response)

    server_class = type("MetricsServer", (_MetricsServer,), {"address_family": socket.AF_INET6 if ":" in addr
                                                              else socket.AF_INET})  # fmt: skip
    httpd = make_server(addr, port, text_format, server_class, handler_class=_QuietHandler)
    threading.Thread(target=httpd.serve_forever, name="kvserve-metrics", daemon=True).start()
    return httpd
