"""What ``kvserve bench serve`` measured, summarised: per-run figures, the side-by-side table, the plot.

Definitions (the ``vllm bench serve`` ones where they exist):

* ``ttft``: first response carrying tokens minus the send time; ``e2e``: last response minus send.
* ``tpot``: ``(e2e - ttft) / (output_tokens - 1)`` per request (requests with one token excluded).
* ``itl``: gaps between consecutive token-carrying responses, pooled over requests.
* ``goodput``: completed requests meeting every ``--goodput`` SLO, per second of the run.
* ``hit_rate``: cached prompt tokens (``Usage.cached_tokens``) / prompt tokens;
  ``hit_of_ideal``: cached prompt tokens / ``datasets.ideal_cached_tokens`` (hits possible).
* ``max_share_ratio``: the busiest worker's completed-request share over the mean share.
* ``split_groups``: of the prefix groups (shared-prefix group, multi-turn user) with two or more
  completed requests, the share served by more than one worker (each split recomputes the prefix).
* ``peak_queue``: the most requests the router's admission queue held in any status poll.
* ``host_hit_rate`` / ``disk_hit_rate``: the share of prompt tokens loaded from the node's host /
  disk tier (docs/architecture.md §3a), from the last status poll: each worker's own rate over its
  lifetime (the run's, with ``--launch``), weighted by its share of the completed requests. The rest
  of ``hit_rate`` is device (pool) hits.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvserve.cluster.bench.datasets import ideal_cached_tokens


@dataclass
class RequestRecord:
    """One request as the driver saw it (times: seconds since the run's start)."""

    conversation: int
    round: int
    tenant: str
    prompt: list[int]
    send_t: float
    group: int = -1
    status: str = "pending"  # ok | failed | rejected
    first_t: float | None = None
    end_t: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    worker_id: str = ""
    preemptions: int = 0
    swaps: int = 0
    migrations: int = 0
    error: str = ""


@dataclass(frozen=True)
class StatusSample:
    """One ``GetClusterStatus`` poll: ``usage`` is each worker's used / total blocks."""

    t: float
    queue_requests: int
    usage: dict[str, float]
    waiting: dict[str, int]
    tier_hit_rates: dict[str, tuple[float, float]] = field(default_factory=dict)  # worker -> (host, disk)


@dataclass
class RunResult:
    """One run: one policy at one request rate."""

    policy: str
    rate: float
    digest: str
    duration_s: float
    block_size: int
    records: list[RequestRecord]
    samples: list[StatusSample]


@dataclass(frozen=True)
class Slo:
    """``--goodput ttft:MS,tpot:MS,e2e:MS`` (None = no bound)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @staticmethod
    def parse(text: str | None) -> Slo:
        """Raises ValueError on an unknown key or a non-positive bound."""
        if not text:
            return Slo()
        values: dict[str, float] = {}
        for part in text.split(","):
            key, _, value = part.partition(":")
            if key not in ("ttft", "tpot", "e2e"):
                raise ValueError(f"--goodput: unknown metric {key!r} (ttft, tpot, e2e)")
            ms = float(value)
            if ms <= 0:
                raise ValueError(f"--goodput: {key} bound must be > 0 ms")
            values[f"{key}_ms"] = ms
        return Slo(**values)

    def met(self, ttft_s: float, tpot_s: float | None, e2e_s: float) -> bool:
        if self.ttft_ms is not None and ttft_s * 1000 > self.ttft_ms:
            return False
        if self.tpot_ms is not None and tpot_s is not None and tpot_s * 1000 > self.tpot_ms:
            return False
        return self.e2e_ms is None or e2e_s * 1000 <= self.e2e_ms


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated ``q``-th percentile (numpy's default); NaN for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


LATENCIES = ("ttft", "tpot", "itl", "e2e")
STATS = ("mean", "median", "p90", "p99")
# (key, label, format) in table order; every key is in ``summarize``'s result.
ROWS: tuple[tuple[str, str, str], ...] = (
    ("completed", "completed", "{:.0f}"),
    ("failed", "failed", "{:.0f}"),
    ("rejected", "rejected (RESOURCE_EXHAUSTED)", "{:.0f}"),
    ("duration_s", "duration (s)", "{:.2f}"),
    ("request_throughput", "requests/s", "{:.2f}"),
    ("output_throughput", "output tok/s", "{:.1f}"),
    ("goodput", "goodput (req/s)", "{:.2f}"),
    *((f"{m}_{s}_ms", f"{m.upper()} {s} (ms)", "{:.1f}") for m in LATENCIES for s in STATS),
    ("hit_rate", "prefix hit rate", "{:.3f}"),
    ("hit_of_ideal", "hit rate / possible", "{:.3f}"),
    ("host_hit_rate", "  of which host tier", "{:.3f}"),
    ("disk_hit_rate", "  of which disk tier", "{:.3f}"),
    ("max_share_ratio", "max worker share / mean", "{:.2f}"),
    ("split_groups", "prefix groups split over workers", "{:.2f}"),
    ("worker_shares", "worker request shares", "{}"),
    ("preemptions", "preemptions", "{:.0f}"),
    ("swaps", "swaps", "{:.0f}"),
    ("migrations", "migrations", "{:.0f}"),
    ("peak_queue", "peak router queue", "{:.0f}"),
)


def summarize(run: RunResult, slo: Slo) -> dict[str, Any]:
    """The figures of one run (see the module doc), keyed as in ``ROWS``, plus identification."""
    ok = [r for r in run.records if r.status == "ok" and r.first_t is not None and r.end_t is not None]
    out: dict[str, Any] = {"policy": run.policy, "rate": run.rate, "digest": run.digest}
    out["completed"] = len(ok)
    out["failed"] = sum(r.status == "failed" for r in run.records)
    out["rejected"] = sum(r.status == "rejected" for r in run.records)
    out["duration_s"] = run.duration_s
    duration = max(run.duration_s, 1e-9)
    out["request_throughput"] = len(ok) / duration
    out["output_throughput"] = sum(len(r.output_ids) for r in ok) / duration
    ttft = [r.first_t - r.send_t for r in ok]  # type: ignore[operator]
    e2e = [r.end_t - r.send_t for r in ok]  # type: ignore[operator]
    tpot_of = [(r.end_t - r.first_t) / (len(r.output_ids) - 1) if len(r.output_ids) > 1 else None for r in ok]  # type: ignore[operator]
    itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)]
    series = {"ttft": ttft, "tpot": [t for t in tpot_of if t is not None], "itl": itl, "e2e": e2e}
    for name, values in series.items():
        ms = [v * 1000 for v in values]
        out[f"{name}_mean_ms"] = sum(ms) / len(ms) if ms else math.nan
        out[f"{name}_median_ms"] = percentile(ms, 50)
        out[f"{name}_p90_ms"] = percentile(ms, 90)
        out[f"{name}_p99_ms"] = percentile(ms, 99)
    good = sum(slo.met(a, b, c) for a, b, c in zip(ttft, tpot_of, e2e, strict=True))
    out["goodput"] = good / duration
    prompt_tokens = sum(len(r.prompt) for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    ideal = ideal_cached_tokens(
        ((r.tenant, r.prompt, r.output_ids) for r in sorted(ok, key=lambda r: r.send_t)), run.block_size
    )
    out["prompt_tokens"] = prompt_tokens
    out["cached_tokens"] = cached
    out["ideal_cached_tokens"] = ideal
    out["hit_rate"] = cached / prompt_tokens if prompt_tokens else math.nan
    out["hit_of_ideal"] = cached / ideal if ideal else math.nan
    shares = Counter(r.worker_id for r in ok)
    workers = sorted({w for s in run.samples for w in s.usage} | set(shares))
    out["worker_shares"] = {w: shares.get(w, 0) / len(ok) if ok else 0.0 for w in workers}
    mean_share = 1 / len(workers) if workers else math.nan
    out["max_share_ratio"] = max(out["worker_shares"].values()) / mean_share if ok and workers else math.nan
    out["split_groups"] = split_groups(ok)
    out["preemptions"] = sum(r.preemptions for r in run.records)
    out["swaps"] = sum(r.swaps for r in run.records)
    out["migrations"] = sum(r.migrations for r in run.records)
    out["peak_queue"] = max((s.queue_requests for s in run.samples), default=0)
    last = run.samples[-1].tier_hit_rates if run.samples else {}
    for i, key in enumerate(("host_hit_rate", "disk_hit_rate")):
        out[key] = sum(out["worker_shares"].get(w, 0.0) * rates[i] for w, rates in last.items())
    return out


def split_groups(records: Sequence[RequestRecord]) -> float:
    """Share of groups (``group >= 0``) with >= 2 requests that more than one worker served (NaN: none)."""
    workers: dict[int, set[str]] = {}
    counts: Counter[int] = Counter()
    for r in records:
        if r.group >= 0:
            workers.setdefault(r.group, set()).add(r.worker_id)
            counts[r.group] += 1
    multi = [g for g, n in counts.items() if n >= 2]
    return sum(len(workers[g]) > 1 for g in multi) / len(multi) if multi else math.nan


def _cell(fmt: str, value: Any) -> str:
    if isinstance(value, dict):
        return " ".join(f"{k.rsplit('-', 1)[-1]}:{v:.2f}" for k, v in value.items())
    if isinstance(value, float) and math.isnan(value):
        return "-"
    return fmt.format(value)


def format_table(summaries: Sequence[dict[str, Any]], baseline: str = "kv_aware") -> str:
    """One markdown table: a row per figure, a column per run, plus ``x / baseline`` ratio columns
    for every other policy at the same rate when ``baseline`` ran."""
    headers = ["metric"]
    columns: list[tuple[str, dict[str, Any], dict[str, Any] | None]] = []
    rates = sorted({s["rate"] for s in summaries})
    for rate in rates:
        at_rate = [s for s in summaries if s["rate"] == rate]
        base = next((s for s in at_rate if s["policy"] == baseline), None)
        for s in at_rate:
            label = s["policy"] if len(rates) == 1 else f"{s['policy']} @ {_rate_label(rate)}"
            columns.append((label, s, None))
        if base is not None:
            for s in at_rate:
                if s is not base:
                    label = f"{s['policy']}/{baseline}" + ("" if len(rates) == 1 else f" @ {_rate_label(rate)}")
                    columns.append((label, s, base))
    headers += [c[0] for c in columns]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for key, label, fmt in ROWS:
        cells = [label]
        for _, s, base in columns:
            if base is None:
                cells.append(_cell(fmt, s[key]))
            else:
                cells.append(_ratio(s[key], base[key]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ratio(value: Any, base: Any) -> str:
    if not isinstance(value, int | float) or not isinstance(base, int | float):
        return ""
    if math.isnan(value) or math.isnan(base) or base == 0:
        return "-"
    return f"{value / base:.2f}x"


def _rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}/s"


def plot(runs: Sequence[RunResult], path: str) -> None:
    """Per run (one column each): per-worker KV usage, router queue and TTFT over time, to ``path``.

    Raises:
        ImportError: matplotlib is missing (``pip install 'kvserve[bench]'``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, len(runs), figsize=(4.5 * len(runs), 8), sharex="col", squeeze=False)
    for col, run in enumerate(runs):
        usage_ax, queue_ax, ttft_ax = axes[0][col], axes[1][col], axes[2][col]
        ts = [s.t for s in run.samples]
        for w in sorted({w for s in run.samples for w in s.usage}):
            usage_ax.plot(ts, [s.usage.get(w, math.nan) for s in run.samples], label=w)
        usage_ax.set_ylim(0, 1.05)
        usage_ax.set_title(f"{run.policy} @ {_rate_label(run.rate)}")
        usage_ax.set_ylabel("KV usage (used/total)")
        usage_ax.legend(fontsize="small")
        queue_ax.plot(ts, [s.queue_requests for s in run.samples], color="black", label="router queue")
        for w in sorted({w for s in run.samples for w in s.waiting}):
            queue_ax.plot(ts, [s.waiting.get(w, 0) for s in run.samples], linestyle=":", label=f"{w} waiting")
        queue_ax.set_ylabel("requests queued")
        queue_ax.legend(fontsize="small")
        by_worker: dict[str, list[tuple[float, float]]] = {}
        for r in run.records:
            if r.status == "ok" and r.first_t is not None:
                by_worker.setdefault(r.worker_id, []).append((r.send_t, (r.first_t - r.send_t) * 1000))
        for w, pts in sorted(by_worker.items()):
            ttft_ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=8, label=w)
        ttft_ax.set_ylabel("TTFT (ms) by send time")
        ttft_ax.set_xlabel("seconds since start")
        ttft_ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
