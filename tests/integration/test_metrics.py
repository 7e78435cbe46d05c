"""Prometheus metrics of a live cluster: each per-worker gauge equals the state it names, counters
count what happened; then a real Prometheus scrapes the cluster and evaluates every expression of
deploy/grafana/kvserve.json and deploy/prometheus/alerts.yml."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.protos.kvserve.v1 import serving_pb2_grpc
from kvserve.router.config import RouterConfig
from kvserve.workers.core.sizes import pool_usage
from kvserve.workers.engine.config import EngineConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
NUM_BLOCKS = 32
BLOCK_SIZE = 16
SHARED = [1000 + i for i in range(64)]  # 4 full blocks every request shares
PROMPTS = [SHARED + [3000 + 10 * i + j for j in range(36)] for i in range(8)]  # 100 tokens = 7 blocks
MAX_TOKENS = 100  # 200 tokens = 13 blocks (9 unshared): 8 requests on 2 workers of 32 blocks -> preemption


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(ray_session, tiny_llama_dir: Path) -> Iterator:
    from kvserve.cluster.launch import start_cluster

    cl = start_cluster(
        EngineConfig(str(tiny_llama_dir), block_size=BLOCK_SIZE, num_gpu_blocks=NUM_BLOCKS, device="cpu",
                     preemption_mode="recompute"),
        2,
        # NOTE: no migration: preemptions stay the workers' own (the counters below compare exactly)
        RouterConfig(port=0, model=str(tiny_llama_dir), enable_migration=False, enable_priority_preemption=False),
        metrics_port=0,
        ready_timeout_s=120,
    )  # fmt: skip
    yield cl
    cl.shutdown()


@pytest.fixture(scope="module")
def stub(cluster) -> Iterator[serving_pb2_grpc.KVServeStub]:
    with grpc.insecure_channel(cluster.address) as channel:
        yield serving_pb2_grpc.KVServeStub(channel)


def generate(stub, ids: list[int]) -> spb.GenerateResponse:  # noqa: ANN001
    tokens, last = 0, None
    request = spb.GenerateRequest(token_ids=spb.TokenIds(ids=ids), sampling=spb.SamplingParams(max_tokens=MAX_TOKENS,
                                  ignore_eos=True))  # fmt: skip
    for resp in stub.Generate(request, timeout=120):
        tokens += len(resp.token_ids)
        last = resp
    assert last is not None and last.finish_reason == "length" and tokens == MAX_TOKENS
    return last


@pytest.fixture(scope="module")
def traffic(cluster, stub) -> list[spb.GenerateResponse]:
    """One request first (caches the shared prefix on its worker), then 8 at once, one invalid."""
    finals = [generate(stub, PROMPTS[0])]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        finals += list(pool.map(lambda p: generate(stub, p), PROMPTS))
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(spb.GenerateRequest(token_ids=spb.TokenIds(ids=[99999])), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return finals


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def idle_snapshot(cluster, stub, timeout: float = 30.0):  # noqa: ANN001, ANN201
    """(metrics, worker stats, status) taken while nothing runs and every report is fresh, and
    stable: two scrapes a report interval apart agree (each idle worker reports >= 1/s)."""
    import ray

    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        status = stub.GetClusterStatus(spb.ClusterStatusRequest(), timeout=10)
        stats = {w: ray.get(h.stats.remote()) for w, h in cluster.workers.items()}
        busy = any(s.num_running or s.num_waiting or s.num_swapped for s in stats.values())
        if not busy and all(0 <= w.last_report_age_s < 2 for w in status.workers):
            samples = scrape(cluster.metrics_port)
            snap = (samples, stats, status)
            if last is not None and _gauges(last) == _gauges(snap) and _consistent(snap):
                return snap
            last = snap
        time.sleep(1.2)
    raise AssertionError("the cluster never settled")


def _gauges(snap) -> dict:  # noqa: ANN001
    samples = snap[0]
    return {k: v for k, v in samples.items() if k[0].startswith("kvserve:kv_") or k[0].startswith("kvserve:num_req")}


def _consistent(snap) -> bool:  # noqa: ANN001
    samples, stats, _ = snap
    return all(value(samples, "kvserve:kv_blocks_free", worker=w) == s.free_blocks for w, s in stats.items())


def test_gauges_equal_worker_state(cluster, stub, traffic) -> None:  # noqa: ANN001
    samples, stats, status = idle_snapshot(cluster, stub)
    by_id = {w.worker_id: w for w in status.workers}
    assert set(stats) == set(by_id) == {"worker-0", "worker-1"}
    for w, s in stats.items():
        st = by_id[w]
        assert value(samples, "kvserve:kv_blocks_total", worker=w) == s.total_blocks == NUM_BLOCKS
        assert st.report.total_blocks == NUM_BLOCKS
        assert value(samples, "kvserve:kv_blocks_free", worker=w) == s.free_blocks == st.report.free_blocks
        assert value(samples, "kvserve:kv_blocks_cached_evictable", worker=w) == s.cached_evictable_blocks
        assert s.cached_evictable_blocks == st.report.cached_evictable_blocks
        assert s.free_blocks + s.used_blocks + s.cached_evictable_blocks == s.total_blocks
        usage = pool_usage(s.used_blocks, s.total_blocks)
        assert value(samples, "kvserve:kv_cache_usage_perc", worker=w) == pytest.approx(usage) == st.usage
        assert value(samples, "kvserve:kv_swap_blocks_used", worker=w) == s.swap_blocks_total - s.swap_blocks_free
        assert value(samples, "kvserve:num_requests_running", worker=w) == s.num_running == st.report.num_running == 0
        assert value(samples, "kvserve:num_requests_waiting", worker=w) == s.num_waiting == st.report.num_waiting
        assert value(samples, "kvserve:num_requests_swapped", worker=w) == s.num_swapped == st.report.num_swapped
        assert value(samples, "kvserve:worker_up", worker=w) == 1.0 and st.healthy
        age = value(samples, "kvserve:pressure_report_age_seconds", worker=w)
        assert 0 <= age < 2.5, "idle workers still report at least every second"
        assert value(samples, "kvserve:pressure_report_timestamp_seconds", worker=w) == pytest.approx(
            time.time(), abs=5
        )
    # prompts were computed: their blocks are cached (evictable) now, not free
    assert sum(s.cached_evictable_blocks for s in stats.values()) > 0
    assert value(samples, "kvserve:router_queue_requests") == 0 == status.router.queue_requests
    assert value(samples, "kvserve:router_queue_blocks") == 0


def test_names_keep_their_colon_whatever_the_scraper_asks(cluster) -> None:  # noqa: ANN001
    """Prometheus asks for OpenMetrics first; the names must still be kvserve:* (client_python#1177)."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{cluster.metrics_port}/metrics",
        headers={"Accept": "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"},
    )
    body = urllib.request.urlopen(request, timeout=10).read().decode()
    assert 'kvserve:kv_cache_usage_perc{worker="worker-0"}' in body
    assert "kvserve_" not in body


def test_counters_count_what_happened(cluster, stub, traffic) -> None:  # noqa: ANN001
    samples, stats, status = idle_snapshot(cluster, stub)
    n = len(traffic)
    assert value(samples, "kvserve:prompt_tokens_total") == sum(len(p) for p in [PROMPTS[0], *PROMPTS])
    assert value(samples, "kvserve:generation_tokens_total") == n * MAX_TOKENS
    hits = queries = 0.0
    for w, s in stats.items():
        h = value(samples, "kvserve:prefix_cache_hits_total", worker=w)
        q = value(samples, "kvserve:prefix_cache_queries_total", worker=w)
        assert (h, q) == (s.prefix_cache_hit_tokens_total, s.prefix_cache_query_tokens_total), w
        hits, queries = hits + h, queries + q
    cached = sum(r.usage.cached_tokens for r in traffic)
    assert hits >= cached > 0, "the shared prefix was served from the cache"
    assert queries >= hits
    preemptions = sum(s.num_preemptions_total for s in stats.values())
    assert preemptions > 0, "one worker runs >= 4 requests: 4 shared + 4 x 9 blocks > 32, someone was preempted"
    assert preemptions == sum(w.report.num_preemptions_total for w in status.workers)
    exported = sum(v for (name, _), v in samples.items() if name == "kvserve:num_preemptions_total")
    assert exported == preemptions
    swaps = sum(s.num_swaps_total for s in stats.values())
    assert value(samples, "kvserve:num_preemptions_total", mode="swap") == swaps
    assert sum(r.num_preemptions for r in traffic) == preemptions, "every preemption hit one of these requests"
    assert value(samples, "kvserve:num_migrations_total") == 0
    assert value(samples, "kvserve:admission_rejections_total", reason="invalid") == 1
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert value(samples, f"kvserve:{hist}_count") == n, hist
        assert value(samples, f"kvserve:{hist}_bucket", le="+Inf") == n, hist
    assert value(samples, "kvserve:inter_token_latency_seconds_count") > 0


def test_the_router_froze_its_start_up_heap_and_times_its_collections(cluster, traffic) -> None:  # noqa: ANN001
    """The router actor's own process: its start-up objects are out of the collector's scans (a full
    collection of them stalls every stream; kvserve/workers/core/gc_pauses.py) and its pauses are exported."""
    samples = scrape(cluster.metrics_port)
    assert value(samples, "kvserve:router_gc_frozen_objects") > 10_000, "Ray, gRPC and the router's modules"
    young = value(samples, "kvserve:router_gc_pause_seconds_count", generation="0")
    assert young > 0, "a router that streamed tokens allocated enough to collect its youngest generation"
    assert value(samples, "kvserve:router_gc_pause_seconds_bucket", generation="0", le="+Inf") == young


# ---- the real Prometheus ---------------------------------------------------------------------------
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
needs_prometheus = pytest.mark.skipif(
    not (PROMETHEUS and PROMTOOL),
    reason="prometheus/promtool not found on PATH (`make test` installs Debian's `prometheus` package)",
)


@needs_prometheus
def test_promtool_accepts_the_deploy_config() -> None:
    out = subprocess.run([PROMTOOL, "check", "config", "prometheus.yml"], cwd=DEPLOY / "prometheus",
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    out = subprocess.run([PROMTOOL, "check", "rules", str(DEPLOY / "prometheus" / "alerts.yml")],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def prom_get(port: int, path: str, **params: str) -> dict:
    url = f"http://127.0.0.1:{port}{path}"
    if params:
        url += "?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def dashboard_exprs() -> list[str]:
    dash = json.loads((DEPLOY / "grafana" / "kvserve.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    # Grafana variables, as Grafana would fill them in
    return [e.replace("$__rate_interval", "30s").replace("$worker", ".*") for e in exprs]


def alert_exprs() -> list[str]:
    doc = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    return [r["expr"] for g in doc["groups"] for r in g["rules"]]


@pytest.fixture(scope="module")
def prometheus(cluster, traffic, tmp_path_factory) -> Iterator[int]:  # noqa: ANN001
    tmp = tmp_path_factory.mktemp("prometheus")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(DEPLOY / "prometheus" / "alerts.yml")],
        "scrape_configs": [
            {"job_name": "kvserve", "static_configs": [{"targets": [f"127.0.0.1:{cluster.metrics_port}"]}]}
        ],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = open(tmp / "prometheus.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, (tmp / "prometheus.log").read_text()
            try:
                result = prom_get(port, "/api/v1/query", query="kvserve:kv_cache_usage_perc")["data"]["result"]
                if len(result) == 2:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                targets = prom_get(port, "/api/v1/targets")["data"]["activeTargets"]
                log.flush()
                pytest.fail(
                    f"kvserve:kv_cache_usage_perc never became queryable; targets: {targets}; "
                    f"log: {(tmp / 'prometheus.log').read_text()[-3000:]}"
                )
            time.sleep(0.5)
        time.sleep(3)  # a few more scrapes, so rate() over the dashboard's window has samples
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


@needs_prometheus
def test_prometheus_scrapes_the_cluster(prometheus: int) -> None:
    result = prom_get(prometheus, "/api/v1/query", query="kvserve:kv_cache_usage_perc")["data"]["result"]
    assert sorted(r["metric"]["worker"] for r in result) == ["worker-0", "worker-1"]
    up = prom_get(prometheus, "/api/v1/query", query='up{job="kvserve"}')["data"]["result"]
    assert [r["value"][1] for r in up] == ["1"]
    generated = prom_get(prometheus, "/api/v1/query", query="kvserve:generation_tokens_total")["data"]["result"]
    assert float(generated[0]["value"][1]) == (len(PROMPTS) + 1) * MAX_TOKENS


# NOTE: this cluster runs without KV tiers (their counters would change the exact counts above), so the
# tier panels have no series here: they are checked for valid PromQL here and for exported names in
# tests/unit/test_deploy.py; tests/unit/test_tier_metrics.py checks what the tier metrics say.
_TIER_METRICS = ("kvserve:tier_", "kvserve:prefix_cache_tier_")


def _tiers_only(expr: str) -> bool:
    names = set(re.findall(r"kvserve:[a-zA-Z0-9_:]+", expr)) - {"kvserve:prefix_cache_queries_total"}
    return bool(names) and all(n.startswith(_TIER_METRICS) for n in names)


@needs_prometheus
@pytest.mark.parametrize("source", ["dashboard", "alerts"])
def test_every_deploy_expression_evaluates(prometheus: int, source: str) -> None:
    exprs = dashboard_exprs() if source == "dashboard" else alert_exprs()
    assert exprs
    failures = []
    for expr in exprs:
        try:
            body = prom_get(prometheus, "/api/v1/query", query=expr)
        except urllib.error.HTTPError as e:  # a bad query is a 400 with the error in the body
            body = json.loads(e.read() or b"{}")
        if body.get("status") != "success":
            failures.append(f"{expr}: {body.get('error', body)}")
        elif source == "dashboard" and not body["data"]["result"] and not _tiers_only(expr):
            failures.append(f"{expr}: no series (a metric name that the cluster does not export?)")
    assert failures == []


@needs_prometheus
def test_alert_rules_load_and_evaluate(prometheus: int) -> None:
    deadline = time.monotonic() + 30
    while True:
        groups = prom_get(prometheus, "/api/v1/rules")["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        if (
            rules
            and all(r.get("lastEvaluation", "").startswith("20") for r in rules)
            and all(r["health"] != "unknown" for r in rules)
        ):
            break
        assert time.monotonic() < deadline, rules
        time.sleep(0.5)
    assert {r["name"] for r in rules} >= {
        "KVServeKVCacheNearlyFull",
        "KVServePressureReportsStale",
        "KVServeWorkerDown",
    }
    assert [r["name"] for r in rules if r["health"] != "ok"] == []
    firing = [r["name"] for r in rules if r["state"] == "firing"]
    assert "KVServeWorkerDown" not in firing and "KVServeRouterDown" not in firing
