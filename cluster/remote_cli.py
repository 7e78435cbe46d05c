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
    from cluster.client import KVServeClient

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


def render_status(status: Any, console: Any = None) -> None:
    """A rich table: one row per worker, then the router's admission queue."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title="kvserve workers", title_justify="left")
    for name, justify in (
        ("worker", "left"), ("up", "center"), ("used/total", "right"), ("usage", "right"),
        ("free", "right"), ("cached", "right"), ("in flight", "right"), ("run", "right"),
        ("wait", "right"), ("swap", "right"), ("preempt", "right"), ("migr out", "right"),
        ("hit rate", "right"), ("step ms", "right"), ("age s", "right"),
    ):  # fmt: skip
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for w in status.workers:
        usage_style = "red" if w.usage >= 0.9 else "yellow" if w.usage >= 0.6 else "green"
        swap = f"{w.num_swapped} ({w.swap_blocks_total - w.swap_blocks_free}/{w.swap_blocks_total})"
        table.add_row(
            w.worker_id,
            "[green]yes[/]" if w.healthy else "[red]NO[/]",
            f"{w.used_blocks}/{w.total_blocks}",
            f"[{usage_style}]{w.usage:.0%}[/]",
            str(w.free_blocks),
            str(w.cached_evictable_blocks),
            str(w.blocks_in_flight),
            str(w.num_running),
            str(w.num_waiting),
            swap if w.swap_blocks_total else str(w.num_swapped),
            str(w.num_preemptions_total),
            str(w.num_migrations_total),
            f"{w.prefix_cache_hit_rate:.0%}",
            f"{w.step_latency_ms:.1f}",
            "-" if w.last_report_age_s < 0 else f"{w.last_report_age_s:.1f}",
        )
    console.print(table)
    r = status.router
    rejections = ", ".join(f"{k}={v}" for k, v in sorted(r.rejections_total.items())) or "none"
    console.print(
        f"router: admission [bold]{r.admission_state or '?'}[/], "
        f"queue {r.queue_requests}/{r.max_queue_requests} requests, {r.queue_blocks}/{r.max_queue_blocks} blocks, "
        f"{r.requests_in_flight} in flight; rejections: {rejections}"
    )
