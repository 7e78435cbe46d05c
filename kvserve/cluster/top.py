"""``kvserve top``: a live terminal view of a cluster's block pressure (``WatchBlockPressure``).

One bar per worker splits its KV pool into used / cached-evictable / free blocks, beside swap,
running/waiting/swapped requests, preemptions and migrations per second (deltas of the workers'
totals between two snapshots), prefix-cache hit rate, the node's host and disk tiers (each: fill %/share
of the worker's prompt tokens loaded from it), step latency, the share of decode steps that replayed a
decode graph and report age; a header line
shows the router queue, admission state and rejections.

``render_frame(prev, cur)`` is a pure function of two ``ClusterStatus`` snapshots (the older may be
None: rates then show "-"), so tests render crafted statuses; ``run_top`` is the loop around it.
Keys: ``q`` quits (stdin in cbreak mode when it is a TTY), as does Ctrl-C. ``--once`` prints one
frame (after two snapshots, so rates are real) and exits: for scripts.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import select
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime

import grpc
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from kvserve.protos.kvserve.v1 import pressure_pb2 as ppb
from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.protos.kvserve.v1 import serving_pb2_grpc
from kvserve.router.config import RouterConfig

BAR_WIDTH = 30
DEFAULT_INTERVAL_MS = 250  # >= 2 refreshes a second


# ---- rendering (pure) ------------------------------------------------------------------------
_DEFAULTS = RouterConfig()


def usage_style(usage: float, high: float = _DEFAULTS.high_watermark, low: float = _DEFAULTS.low_watermark) -> str:
    """Red at or above the router's high watermark (the worker sheds work), yellow above its low one
    (no longer a migration target), green below."""
    return "red" if usage >= high else "yellow" if usage > low else "green"


def block_bar(
    total: int, used: int, cached: int, width: int = BAR_WIDTH, style: Callable[[float], str] = usage_style
) -> Text:
    """``width`` cells: used (█), cached-evictable (▒), free (░), proportional to blocks.

    A non-zero share always gets at least one cell, so a single used block is visible.
    """
    if total <= 0:
        return Text("·" * width, style="dim")
    used, cached = max(0, min(used, total)), max(0, min(cached, total - max(0, min(used, total))))

    def cells(n: int) -> int:
        return 0 if n <= 0 else max(1, round(n / total * width))

    u = min(cells(used), width)
    c = min(cells(cached), width - u)
    bar = Text()
    bar.append("█" * u, style=style(used / total))
    bar.append("▒" * c, style="blue")
    bar.append("░" * (width - u - c), style="dim")
    return bar


def _rate(cur: float, prev: float | None, dt: float | None) -> str:
    if prev is None or not dt or dt <= 0:
        return "-"
    return f"{max(0.0, cur - prev) / dt:.1f}"


def _short_node(node_id: str) -> str:
    return node_id[:8] if node_id else "-"


# (header, justify, min cells, droppable: lower drops first (0 = never)) per column, in order.
_COLUMNS = (
    ("worker", "left", 10, 0),
    ("node", "left", 10, 2),
    ("KV blocks", "left", 0, 0),  # the bar: takes what the others leave
    ("used", "right", 6, 0),
    ("evict", "right", 7, 0),
    ("free", "right", 6, 0),
    ("use%", "right", 6, 0),
    ("tp", "right", 4, 3),  # ranks of the worker's tensor-parallel group (one worker, one pool)
    ("swap", "right", 7, 5),
    ("run", "right", 5, 0),
    ("wait", "right", 6, 0),
    ("swp", "right", 5, 0),
    ("preempt/s", "right", 11, 0),
    ("migr/s", "right", 8, 0),
    ("hit%", "right", 6, 4),
    ("host", "right", 9, 5),  # the node's host tier: fill %, share of prompt tokens loaded from it
    ("disk", "right", 9, 5),  # the node's disk tier, likewise
    ("step ms", "right", 9, 2),
    # NOTE: graph% drops first: "-" on CPU, and a frame for scripts (160 cells off a terminal) keeps the node
    ("graph%", "right", 8, 1),  # share of the decode steps since the last frame that replayed a decode graph
    ("age s", "right", 7, 3),
)
_MIN_BAR, _MAX_BAR = 10, 40


_SHORT = {"preempt/s": ("pre/s", 7), "migr/s": ("mig/s", 7)}  # headers in narrow terminals


def _layout(width: int | None, bar_width: int) -> tuple[dict[str, str], int]:
    """Columns to show (name -> header) and the bar width for a ``width``-cell terminal
    (None = every column, ``bar_width``-cell bars)."""
    if width is None:
        return {c[0]: c[0] for c in _COLUMNS}, bar_width
    cols = [(name, name, cells, level) for name, _, cells, level in _COLUMNS]

    def fits(cols: list) -> bool:
        return width - sum(c[2] for c in cols) - 2 >= _MIN_BAR + 10

    for level in (1, 2, 3, 4):
        if fits(cols):
            break
        cols = [c for c in cols if c[3] != level]
    if not fits(cols):
        cols = [(n, *_SHORT[n], lv) if n in _SHORT else (n, h, c, lv) for n, h, c, lv in cols if lv != 5]
    bar = max(_MIN_BAR, min(_MAX_BAR, width - sum(c[2] for c in cols) - 2))
    return {name: header for name, header, _, _ in cols}, bar


def _share(part: int, whole: int) -> str:
    """``part`` of ``whole`` as a whole percentage (0% of nothing)."""
    return f"{100 * part / whole:.0f}%" if whole else "0%"


def _tier(r: ppb.PressureReport, tier: str) -> str:
    """``<fill>%/<hit>%``: how full the node's ``tier`` ("host" or "disk") is and the share of this
    worker's prompt tokens loaded from it (docs/architecture.md §3a); "-" without one."""
    capacity = getattr(r, f"{tier}_cache_bytes_capacity")
    if not capacity:
        return "-"
    fill = _share(getattr(r, f"{tier}_cache_bytes_used"), capacity)
    return f"{fill}/{_share(getattr(r, f'prefix_cache_{tier}_hit_tokens_total'), r.prefix_cache_query_tokens_total)}"


def _graph_share(r: ppb.PressureReport, prev: ppb.PressureReport | None) -> str:
    """The share of the decode steps between two reports that replayed a decode graph ("-": no earlier
    report or no step since). Low on a GPU while decoding: batches past the largest graph, or prefill."""
    steps = r.decode_steps - prev.decode_steps if prev is not None else 0
    if steps <= 0:
        return "-"
    return _share(max(0, r.decode_graph_steps_total - prev.decode_graph_steps_total), steps)


def render_frame(
    prev: spb.ClusterStatus | None,
    cur: spb.ClusterStatus,
    *,
    server: str = "",
    bar_width: int = BAR_WIDTH,
    width: int | None = None,
) -> RenderableType:
    """The whole frame for ``cur`` (rates from ``prev``, the snapshot before it, when given).

    ``width`` (terminal cells) drops the least useful columns and sizes the bars to fit; None shows
    every column with ``bar_width``-cell bars.
    """
    dt = (cur.timestamp_ms - prev.timestamp_ms) / 1000 if prev is not None else None
    before = {w.worker_id: w for w in prev.workers} if prev is not None else {}
    r = cur.router
    healthy = sum(1 for w in cur.workers if w.healthy)
    rejections = sum(r.rejections_total.values())
    prev_rejections = sum(prev.router.rejections_total.values()) if prev is not None else None
    when = datetime.fromtimestamp(cur.timestamp_ms / 1000).strftime("%H:%M:%S") if cur.timestamp_ms else "--:--:--"

    header = Text()
    header.append("kvserve top", style="bold")
    if server:
        header.append(f"  {server}")
    header.append(f"  {when}  ")
    all_up = healthy == len(cur.workers)
    header.append(f"workers {healthy}/{len(cur.workers)} healthy", style="green" if all_up else "red")
    header.append(f"  in flight {r.requests_in_flight}")
    header.append(f"\nrouter queue {r.queue_requests}/{r.max_queue_requests} req, {r.queue_blocks} blocks  ")
    state = r.admission_state or "open"
    header.append(f"[{state}]", style={"open": "green", "queueing": "yellow"}.get(state, "red"))
    wait = "?" if r.projected_wait_s < 0 else f"{r.projected_wait_s:.1f}s"
    header.append(f"  projected wait {wait}")
    header.append(f"  rejections {rejections} ({_rate(rejections, prev_rejections, dt)}/s)")
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(r.rejections_total.items()) if v)
    if reasons:
        header.append(f": {reasons}")
    if r.replays_total:
        header.append(f"  failover replays {r.replays_total}", style="yellow")

    shown, bar = _layout(width, bar_width)
    # NOTE: a router older than the fields sends neither: colour by the defaults then.
    high = r.high_watermark if r.HasField("high_watermark") else _DEFAULTS.high_watermark
    low = r.low_watermark if r.HasField("low_watermark") else _DEFAULTS.low_watermark

    def style(usage: float) -> str:
        return usage_style(usage, high, low)

    table = Table(box=None, pad_edge=False, header_style="bold", expand=False)
    for name, justify, _, _ in _COLUMNS:
        if name in shown:
            table.add_column(shown[name], justify=justify, no_wrap=True, style="dim" if name == "node" else None)
    for w in cur.workers:
        p = before.get(w.worker_id)
        r, pr = w.report, (p.report if p is not None else None)  # the worker's last report, as it sent it
        name = Text(w.worker_id, style="bold" if w.healthy else "bold red")
        if not w.healthy:
            # NOTE: "down" = dead or restarting, "retired" = crash loop, stays down
            name.append(f" ✗ {w.state}" if w.state and w.state != "up" else " ✗")
        if w.restarts_total:
            name.append(f" ↻{w.restarts_total}", style="yellow")
        cells = {
            "worker": name,
            "node": _short_node(w.node_id),
            "tp": str(w.tensor_parallel_size or 1),
            "KV blocks": block_bar(int(r.total_blocks), int(r.used_blocks), int(r.cached_evictable_blocks), bar, style),
            "used": str(r.used_blocks),
            "evict": str(r.cached_evictable_blocks),
            "free": str(r.free_blocks),
            "use%": Text(f"{w.usage * 100:.0f}%", style=style(w.usage)),
            "swap": f"{r.swap_blocks_total - r.swap_blocks_free}/{r.swap_blocks_total}" if r.swap_blocks_total else "-",
            "run": str(r.num_running),
            "wait": str(r.num_waiting),
            "swp": str(r.num_swapped),
            "preempt/s": _rate(r.num_preemptions_total, pr.num_preemptions_total if pr else None, dt),
            "migr/s": _rate(w.num_migrations_total, p.num_migrations_total if p else None, dt),
            "hit%": _share(r.prefix_cache_hit_tokens_total, r.prefix_cache_query_tokens_total),
            "host": _tier(r, "host"),
            "disk": _tier(r, "disk"),
            "step ms": f"{r.step_latency_ms:.1f}",
            "graph%": _graph_share(r, pr),
            "age s": "never" if w.last_report_age_s < 0 else f"{w.last_report_age_s:.1f}",
        }
        table.add_row(*(cells[c] for c in shown))
    legend = Text()
    legend.append("█", style="green")
    legend.append(" used  ")
    legend.append("▒", style="blue")
    legend.append(" cached (evictable)  ")
    legend.append("░", style="dim")
    legend.append(" free", style="dim")
    if not cur.workers:
        return Group(header, Text("no workers registered", style="yellow"), legend)
    return Group(header, table, legend)


def render_text(prev: spb.ClusterStatus | None, cur: spb.ClusterStatus, *, server: str = "", width: int = 140) -> str:
    """``render_frame`` as plain text (no colours), ``width`` columns wide."""
    buf = io.StringIO()
    console = Console(file=buf, width=width, color_system=None, force_terminal=False, legacy_windows=False)
    console.print(render_frame(prev, cur, server=server, width=width))
    return buf.getvalue()


# ---- the client ------------------------------------------------------------------------------
def open_stub(server: str, tls_ca: str | None = None) -> tuple[grpc.Channel, serving_pb2_grpc.KVServeStub]:
    """A channel to the router (TLS when ``tls_ca`` names a PEM CA) and its KVServe stub."""
    from kvserve.cluster.client import open_channel

    channel = open_channel(grpc, server, tls_ca, None, None, None)
    return channel, serving_pb2_grpc.KVServeStub(channel)


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


class _Watcher:
    """Reads WatchBlockPressure on a thread, keeping the last two snapshots; reconnects on error."""

    def __init__(self, stub: serving_pb2_grpc.KVServeStub, interval_ms: int, metadata: tuple) -> None:
        self._stub, self._interval_ms, self._metadata = stub, interval_ms, metadata
        self._lock = threading.Lock()
        self.prev: spb.ClusterStatus | None = None
        self.cur: spb.ClusterStatus | None = None
        self.error: str | None = None
        self.fatal: grpc.RpcError | None = None
        self.version = 0
        self._call = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvserve-top-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        call = self._call
        if call is not None:
            call.cancel()

    def snapshot(self) -> tuple[spb.ClusterStatus | None, spb.ClusterStatus | None, int]:
        with self._lock:
            return self.prev, self.cur, self.version

    def _run(self) -> None:
        backoff = 0.25
        while not self._stop.is_set():
            try:
                self._call = self._stub.WatchBlockPressure(
                    spb.WatchRequest(interval_ms=self._interval_ms), metadata=self._metadata
                )
                for status in self._call:
                    with self._lock:
                        self.prev, self.cur = self.cur, status
                        self.error = None
                        self.version += 1
                    backoff = 0.25
            except grpc.RpcError as e:
                if self._stop.is_set():
                    return
                if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    self.fatal = e
                    return
                with self._lock:
                    self.error = f"{e.code().name}: {e.details()} (reconnecting)"
            self._stop.wait(backoff)
            backoff = min(backoff * 2, 2.0)


@contextlib.contextmanager
def _cbreak_keys() -> Iterator[Callable[[float], str | None]]:
    """Yields ``read_key(timeout) -> str | None``; stdin in cbreak mode while it is a TTY."""
    if not sys.stdin.isatty():

        def no_key(timeout: float) -> str | None:
            time.sleep(timeout)
            return None

        yield no_key
        return
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)

        def read_key(timeout: float) -> str | None:
            ready, _, _ = select.select([fd], [], [], timeout)
            return os.read(fd, 1).decode(errors="replace") if ready else None

        yield read_key
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _waiting(server: str, error: str | None) -> RenderableType:
    return Text(f"kvserve top  {server}\n{error or 'connecting...'}", style="yellow")


def run_once(stub: serving_pb2_grpc.KVServeStub, server: str, interval_ms: int, metadata: tuple, width: int) -> str:
    """Two snapshots ``interval_ms`` apart, rendered as one plain-text frame."""
    call = stub.WatchBlockPressure(spb.WatchRequest(interval_ms=interval_ms), metadata=metadata, timeout=30)
    try:
        it = iter(call)
        first = next(it)
        second = next(it)
    finally:
        call.cancel()
    return render_text(first, second, server=server, width=width)


def run_top(args: argparse.Namespace) -> int:
    interval_ms = max(50, int(args.interval_ms))
    channel, stub = open_stub(args.server, args.tls_ca)
    metadata = auth_metadata(args.auth_token)
    try:
        if args.once:
            try:
                width = Console().width if sys.stdout.isatty() else 160
                sys.stdout.write(run_once(stub, args.server, interval_ms, metadata, max(width, 100)))
                sys.stdout.flush()
            except grpc.RpcError as e:
                print(f"error: {args.server}: {e.code().name}: {e.details()}", file=sys.stderr)
                return 1
            return 0
        watcher = _Watcher(stub, interval_ms, metadata)
        watcher.start()
        console = Console()
        try:
            with (
                _cbreak_keys() as read_key,
                Live(_waiting(args.server, None), console=console, auto_refresh=False, transient=False) as live,
            ):
                seen = -1
                while True:
                    if watcher.fatal is not None:
                        e = watcher.fatal
                        live.stop()
                        print(f"error: {args.server}: {e.code().name}: {e.details()}", file=sys.stderr)
                        return 2
                    prev, cur, version = watcher.snapshot()
                    if cur is None:
                        live.update(_waiting(args.server, watcher.error), refresh=True)
                    elif version != seen or watcher.error:
                        seen = version
                        frame = render_frame(prev, cur, server=args.server, width=console.width)
                        if watcher.error:
                            frame = Group(frame, Text(watcher.error, style="red"))
                        live.update(frame, refresh=True)
                    key = read_key(min(0.1, interval_ms / 2000))
                    if key in ("q", "Q"):
                        return 0
        except KeyboardInterrupt:
            return 0
        finally:
            watcher.stop()
    finally:
        channel.close()


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "top",
        help="live view of a cluster's KV block pressure",
        description="A live view of every worker's KV pool (WatchBlockPressure). q or Ctrl-C quits.",
    )
    p.add_argument("--server", default="127.0.0.1:50051", help="HOST:PORT of the router (default: 127.0.0.1:50051)")
    p.add_argument(
        "--auth-token",
        default=os.environ.get("KVSERVE_AUTH_TOKEN"),
        help="bearer token (default: $KVSERVE_AUTH_TOKEN)",
    )
    p.add_argument("--tls-ca", default=None, help="PEM CA certificate: connect with TLS")
    p.add_argument(
        "--interval-ms", type=int, default=DEFAULT_INTERVAL_MS, help=f"refresh interval (default {DEFAULT_INTERVAL_MS})"
    )
    p.add_argument("--once", action="store_true", help="print one frame and exit (for scripts)")
    p.set_defaults(func=run_top)
