"""``kvserve status --server HOST:PORT``: one ``GetClusterStatus`` call, as a table or JSON."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

DEFAULT_SERVER = "127.0.0.1:50051"  # RouterConfig's default host and port


def add_connection_arguments(p: argparse.ArgumentParser) -> None:
    """``--server``, ``--auth-token``, TLS and ``--timeout``: how to reach a router."""
    g = p.add_argument_group("connection")
    g.add_argument(
        "--server",
        default=os.environ.get("KVSERVE_SERVER", DEFAULT_SERVER),
        help=f"HOST:PORT of the router (default: $KVSERVE_SERVER or {DEFAULT_SERVER})",
    )
    g.add_argument(
        "--auth-token",
        default=os.environ.get("KVSERVE_AUTH_TOKEN"),
        help="bearer token (default: $KVSERVE_AUTH_TOKEN)",
    )
    g.add_argument("--tls-ca", default=None, help="PEM CA of the router's certificate: use TLS")
    g.add_argument("--tls-cert", default=None, help="PEM client certificate (mTLS)")
    g.add_argument("--tls-key", default=None, help="PEM client key (mTLS)")
    g.add_argument("--timeout", type=float, default=10.0, help="seconds per call (default: 10)")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("status", help="per-worker KV block pressure of a running cluster")
    add_connection_arguments(p)
    p.add_argument("--json", action="store_true", help="print the ClusterStatus as JSON")
    p.set_defaults(func=cmd_status)


def client_from_args(args: argparse.Namespace):
    from kvserve.cluster.client import KVServeClient

    return KVServeClient(
        args.server,
        auth_token=args.auth_token or None,
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        timeout=args.timeout,
    )


def status_dict(status: Any) -> dict[str, Any]:
    """The ClusterStatus as JSON-ready data: proto field names, zeros included, 64-bit ints as ints."""
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(
        status,
        always_print_fields_with_no_presence=True,
        preserving_proto_field_name=True,
        unquote_int64_if_possible=True,
    )


def cmd_status(args: argparse.Namespace) -> int:
    import grpc

    try:
        with client_from_args(args) as client:
            status = client.status()
    except grpc.RpcError as e:
        print(f"error: {args.server}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:  # unreadable TLS files, cert without key
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(status_dict(status), indent=2, sort_keys=True))
    else:
        render_status(status)
    return 0


# Below this many columns the worker table is split in two (pressure, then activity) with short
# headers: the 16-column table needs ~135 columns, and rich would otherwise squeeze every header
# to one letter and an ellipsis (a pipe gets 80 columns).
WIDE_TABLE_MIN_COLUMNS = 140

# (header, justify, cell) per column; cells are rich markup strings.
_Column = tuple[str, str, "Any"]


def _usage_cell(w: Any) -> str:
    style = "red" if w.usage >= 0.9 else "yellow" if w.usage >= 0.6 else "green"
    return f"[{style}]{w.usage:.0%}[/]"


def _swap_blocks_cell(w: Any) -> str:
    r = w.report
    return f"{r.swap_blocks_total - r.swap_blocks_free}/{r.swap_blocks_total}" if r.swap_blocks_total else "-"


def _hit_cell(w: Any) -> str:
    """The share of the worker's prompt tokens found in its prefix cache (0% before any)."""
    queried, hit = w.report.prefix_cache_query_tokens_total, w.report.prefix_cache_hit_tokens_total
    return f"{hit / queried:.0%}" if queried else "0%"


_WORKER: _Column = ("worker", "left", lambda w: w.worker_id)
_PRESSURE: list[_Column] = [
    ("up", "center", lambda w: "[green]yes[/]" if w.healthy else "[red]NO[/]"),
    ("used/total", "right", lambda w: f"{w.report.used_blocks}/{w.report.total_blocks}"),
    ("usage", "right", _usage_cell),
    ("free", "right", lambda w: str(w.report.free_blocks)),
    ("cached", "right", lambda w: str(w.report.cached_evictable_blocks)),
    ("in flight", "right", lambda w: str(w.blocks_in_flight)),
    ("swap", "right", _swap_blocks_cell),
]
_ACTIVITY: list[_Column] = [
    ("run", "right", lambda w: str(w.report.num_running)),
    ("wait", "right", lambda w: str(w.report.num_waiting)),
    ("swapped", "right", lambda w: str(w.report.num_swapped)),
    ("preempt", "right", lambda w: str(w.report.num_preemptions_total)),
    ("migr", "right", lambda w: str(w.num_migrations_total)),
    ("hit", "right", _hit_cell),
    ("ms/step", "right", lambda w: f"{w.report.step_latency_ms:.1f}"),
    ("age s", "right", lambda w: "-" if w.last_report_age_s < 0 else f"{w.last_report_age_s:.1f}"),
]


def render_status(status: Any, console: Any = None) -> None:
    """Rich tables: the workers (one row each; one wide table, or two narrow ones below
    ``WIDE_TABLE_MIN_COLUMNS``), then the router's admission queue. Readable at 80 columns and
    when piped: no header or value is ever truncated."""
    from rich.console import Console

    console = console or Console()
    if console.width >= WIDE_TABLE_MIN_COLUMNS:
        console.print(_worker_table("kvserve workers", [_WORKER, *_PRESSURE, *_ACTIVITY], status.workers))
    else:
        console.print(_worker_table("kvserve workers: KV blocks", [_WORKER, *_PRESSURE], status.workers))
        console.print(_worker_table("kvserve workers: activity", [_WORKER, *_ACTIVITY], status.workers))
    r = status.router
    rejections = ", ".join(f"{k}={v}" for k, v in sorted(r.rejections_total.items())) or "none"
    console.print(
        f"router: admission [bold]{r.admission_state or '?'}[/], "
        f"queue {r.queue_requests}/{r.max_queue_requests} requests, {r.queue_blocks}/{r.max_queue_blocks} blocks, "
        f"{r.requests_in_flight} in flight; rejections: {rejections}"
    )


def _worker_table(title: str, columns: list[_Column], workers: Any) -> Any:
    from rich import box
    from rich.table import Table

    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for name, justify, _ in columns:
        table.add_column(name, justify=justify, no_wrap=True, min_width=len(name))  # type: ignore[arg-type]
    for w in workers:
        table.add_row(*(cell(w) for _, _, cell in columns))
    return table
