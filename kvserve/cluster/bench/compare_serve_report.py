"""The figures of ``kvserve bench compare-serve``: one client result per target and round, their medians,
the kvserve/target ratios, and the side-by-side table (markdown, paste-able into RESULTS.md).

Ratios are of medians over rounds, always kvserve / target: above 1 for output tok/s means kvserve
serves more; below 1 for TTFT / TPOT / ITL means kvserve is faster. The issue's targets read directly
off them (e.g. tok/s >= 2.0 against one ``vllm serve``, TTFT p50 <= 0.5, TPOT p50 <= 1.0).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

# (field, column header): the metrics the table shows, in order.
METRICS = (
    ("output_tokens_per_s", "output tok/s"),
    ("ttft_p50_ms", "TTFT p50 ms"),
    ("ttft_p90_ms", "TTFT p90 ms"),
    ("tpot_p50_ms", "TPOT p50 ms"),
    ("itl_p50_ms", "ITL p50 ms"),
)
OURS = "kvserve"


class ResultError(ValueError):
    """A client's result file lacks a figure the comparison needs."""


@dataclass(frozen=True)
class ClientResult:
    """One client run against one target (one round)."""

    output_tokens_per_s: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    tpot_p50_ms: float
    itl_p50_ms: float
    completed: int
    failed: int


def _number(result: dict, key: str) -> float:
    value = result.get(key)
    if not isinstance(value, int | float):
        raise ResultError(f"result has no number {key!r} (keys: {sorted(result)[:40]})")
    return float(value)


def parse_vllm_bench(result: dict) -> ClientResult:
    """A ``vllm bench serve --save-result`` JSON document (run with ``--percentile-metrics ttft,tpot,itl
    --metric-percentiles 50,90``).

    Raises:
        ResultError: a figure is missing, or no request completed.
    """
    completed = int(_number(result, "completed"))
    if completed == 0:
        raise ResultError("no request completed (see the client's output)")
    return ClientResult(
        output_tokens_per_s=_number(result, "output_throughput"),
        ttft_p50_ms=_number(result, "median_ttft_ms"),
        ttft_p90_ms=_number(result, "p90_ttft_ms"),
        tpot_p50_ms=_number(result, "median_tpot_ms"),
        itl_p50_ms=_number(result, "median_itl_ms"),
        completed=completed,
        failed=int(result.get("failed") or 0),
    )


def _stat(metrics: dict, name: str, stat: str = "median", group: str = "successful") -> float:
    """One statistic of a guidellm metric: a key of its summary (``median``, ``mean``) or a percentile
    (``p90``) of the requests in ``group`` (``successful``, ``total``)."""
    entry = metrics.get(name)
    summary = entry.get(group) if isinstance(entry, dict) else None
    if isinstance(summary, dict) and stat[:1] == "p" and stat[1:].isdigit():
        summary = summary.get("percentiles")
    value = summary.get(stat) if isinstance(summary, dict) else None
    if not isinstance(value, int | float):
        raise ResultError(f"guidellm result has no {name}.{group}.{stat}")
    return float(value)


def parse_guidellm(report: dict) -> ClientResult:
    """The first benchmark of a guidellm (0.8) JSON report: output tok/s is its server throughput (output
    tokens per second over the whole benchmark, all requests); latencies over the successful requests.

    Raises:
        ResultError: no benchmark, a figure missing, or no request completed.
    """
    benchmarks = report.get("benchmarks")
    if not isinstance(benchmarks, list) or not benchmarks:
        raise ResultError("guidellm result has no benchmark")
    metrics = benchmarks[0].get("metrics", {})
    totals = metrics.get("request_totals", {})
    completed = int(totals.get("successful") or 0)
    if completed == 0:
        raise ResultError("guidellm: no request completed (see its log)")
    return ClientResult(
        output_tokens_per_s=_stat(metrics, "output_tokens_per_second", "mean", "total"),
        ttft_p50_ms=_stat(metrics, "time_to_first_token_ms"),
        ttft_p90_ms=_stat(metrics, "time_to_first_token_ms", "p90"),
        tpot_p50_ms=_stat(metrics, "time_per_output_token_ms"),
        itl_p50_ms=_stat(metrics, "inter_token_latency_ms"),
        completed=completed,
        failed=int(totals.get("errored") or 0) + int(totals.get("incomplete") or 0),
    )


def medians(runs: list[ClientResult]) -> dict[str, float]:
    """Per-metric median over rounds."""
    if not runs:
        raise ValueError("no rounds")
    return {key: statistics.median(getattr(r, key) for r in runs) for key, _ in METRICS}


def ratios(ours: dict[str, float], theirs: dict[str, float]) -> dict[str, float | None]:
    """kvserve / target per metric (None where the target's figure is 0)."""
    return {key: (ours[key] / theirs[key] if theirs[key] else None) for key, _ in METRICS}


def summarize(results: dict[str, list[ClientResult]]) -> dict:
    """``{target: {"rounds": [...], "median": {...}, "ratio": {...}, "round_ratios": [...], "failed": n}}``;
    ``ratio`` (kvserve / target, of the medians) and ``round_ratios`` (output tok/s, round by round) are
    there for every target but kvserve, when kvserve is among the results."""
    out: dict = {}
    ours = medians(results[OURS]) if results.get(OURS) else None
    for name, runs in results.items():
        if not runs:
            continue
        med = medians(runs)
        entry: dict = {"rounds": [asdict(r) for r in runs], "median": med, "failed": sum(r.failed for r in runs)}
        if ours is not None and name != OURS:
            entry["ratio"] = ratios(ours, med)
            entry["round_ratios"] = [
                a.output_tokens_per_s / b.output_tokens_per_s if b.output_tokens_per_s else None
                for a, b in zip(results[OURS], runs, strict=False)
            ]
        out[name] = entry
    return out


def _fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def format_table(summary: dict, title: str) -> str:
    """A markdown table: per target the medians (tok/s with its per-round values), failed requests,
    then one row per other target of kvserve / target ratios."""
    head = ["target", *(h for _, h in METRICS), "failed"]
    lines = [f"**{title}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, entry in summary.items():
        med = entry["median"]
        rounds = ", ".join(_fmt(r["output_tokens_per_s"]) for r in entry["rounds"])
        cells = [f"{_fmt(med['output_tokens_per_s'])} ({rounds})"]
        cells += [_fmt(med[key], 0 if med[key] >= 100 else 1) for key, _ in METRICS[1:]]  # ms
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {entry['failed']} |")
    for name, entry in summary.items():
        if "ratio" in entry:
            cells = [_ratio(entry["ratio"][key]) for key, _ in METRICS]
            lines.append(f"| {OURS} / {name} | " + " | ".join(cells) + " | |")
    return "\n".join(lines)


def cpu_summary(cpu_rounds: dict[str, list[dict]]) -> dict:
    """Per target: its rounds' ``{"cpu_seconds": {role: s}, "duration_s": d}`` and, over the rounds that
    have a duration, the median cores by role (CPU seconds / duration) and in all; over the rounds that
    say how many tokens they streamed (``output_tokens``), kvserve's router and frontends' median CPU
    microseconds per streamed token (``stack_seconds``, ``kvserve/cluster/bench/cpu_share.py``)."""
    out: dict = {}
    for target, rounds in cpu_rounds.items():
        counted = [r for r in rounds if r.get("output_tokens") and r.get("stack_seconds")]
        us_per_token = {
            part: statistics.median(r["stack_seconds"][part] / r["output_tokens"] * 1e6 for r in counted)
            for part in (counted[0]["stack_seconds"] if counted else ())
        }  # fmt: skip
        cores = [
            {role: s / r["duration_s"] for role, s in r["cpu_seconds"].items()} for r in rounds if r.get("duration_s")
        ]
        median_cores = {role: statistics.median(c[role] for c in cores) for role in cores[0]} if cores else {}
        if cores:
            median_cores["all"] = statistics.median(sum(c.values()) for c in cores)
        out[target] = {"rounds": rounds, "median_cores": median_cores, "median_us_per_token": us_per_token}
    return out


def format_cpu_table(summary: dict, machine_cores: int | None) -> str:
    """A markdown table: per target, the median cores each role used while the client ran."""
    roles = next((list(e["median_cores"]) for e in summary.values() if e["median_cores"]), [])
    if not roles:
        return "**CPU by role**: no benchmark duration to divide by"
    title = (
        f"**CPU by role while vllm bench serve ran** (cores = CPU seconds / benchmark duration, medians; "
        f"the machine has {machine_cores}; the client's figure includes its own start-up)"
    )
    lines = [title, "", "| target | " + " | ".join(roles) + " |", "|" + "---|" * (len(roles) + 1)]
    for name, entry in summary.items():
        med = entry["median_cores"]
        lines.append(f"| {name} | " + " | ".join(_fmt(med.get(role), 2) for role in roles) + " |")
    per_token = [f"{name}: " + ", ".join(f"{part} {_fmt(us, 1)}" for part, us in entry["median_us_per_token"].items())
                 for name, entry in summary.items() if any(entry.get("median_us_per_token", {}).values())]  # fmt: skip
    if per_token:
        lines += ["", "**CPU per streamed token** (us, medians): " + "; ".join(per_token)]
    return "\n".join(lines)
