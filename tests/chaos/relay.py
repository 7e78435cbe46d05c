"""A TCP relay between the workers' WorkerLinks and the router, for partition tests (issue 41 item 5).

The workers dial the relay (``kvserve serve --worker-link-address``), the relay dials the router. It
can cut one worker process's link (told apart by the pid owning the connecting socket, as psutil
sees it) for N seconds while every process keeps running:

* ``blackhole``: bytes stop arriving both ways and nothing is closed, as a network partition (or a
  dead switch) does: neither end hears anything, so the router notices only by its own clocks
  (the stall rule, keepalive); what each side sent meanwhile is held "in the network" (read and kept
  by the relay, in order) and delivered when the window ends, the stale incarnation's outputs
  included even if its process was killed meanwhile;
* ``sever``: the process's connections are reset and its reconnects refused until the window ends,
  as a partition that its TCP stack notices does: the router sees the link drop at once (the
  link-grace clause of kvserve/router/table/liveness.py).

Pure sockets and threads: nothing in the cluster knows the relay exists.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

import psutil

_CHUNK = 1 << 16
_POLL_S = 0.05


def _reset(sock: socket.socket) -> None:
    """Close with RST (SO_LINGER 0): the peer sees the connection reset, not a clean close."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


def _pid_of(peer: tuple[str, int]) -> int | None:
    """The pid owning the local TCP socket at ``peer`` (the other end of an accepted connection)."""
    for c in psutil.net_connections(kind="tcp"):
        # NOTE: gRPC's core dials from an IPv6 socket: its address is the v4-mapped ``::ffff:127.0.0.1``
        if c.laddr and c.laddr.port == peer[1] and c.laddr.ip.removeprefix("::ffff:") == peer[0] and c.pid:
            return c.pid
    return None


@dataclass(eq=False)
class _Link:
    """One relayed connection: ``down`` (the worker's side), ``up`` (the router's)."""

    pid: int | None
    down: socket.socket
    up: socket.socket
    closed: threading.Event = field(default_factory=threading.Event)
    late_bytes: int = 0  # bytes from the worker forwarded after a blackhole window ended
    _ended: int = 0  # directions whose pump has ended
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def direction_ended(self, dst: socket.socket) -> None:
        """One direction is over: its peer sees the end (FIN); the link closes once both are over.
        NOTE: not at once: the other direction may still owe what a blackhole held (a dead worker's
        socket fails the router's direction first, while the worker's held bytes wait to go on)."""
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
        with self._lock:
            self._ended += 1
            both = self._ended == 2
        if both:
            self.close()

    def close(self, reset: bool = False) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        for s in (self.down, self.up):
            if reset:
                _reset(s)
            else:
                with contextlib.suppress(OSError):
                    s.close()


class TcpRelay:
    """Relays connections from ``127.0.0.1:<port>`` to ``target``; ``close`` stops it.

    Args:
        target: the router's WorkerLink address, ``(host, port)``.
    """

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._links: list[_Link] = []
        self._accepted: dict[int | None, int] = {}  # connections accepted per pid
        self._cut: dict[int, tuple[float, str]] = {}  # pid -> (until, "blackhole" | "sever")
        self._stop = threading.Event()
        threading.Thread(target=self._accept, name="relay-accept", daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    # ---- control ----------------------------------------------------------------------------------
    def connections_of(self, pid: int) -> int:
        """Connections accepted from ``pid`` so far (a reconnect adds one)."""
        with self._lock:
            return self._accepted.get(pid, 0)

    def late_bytes_of(self, pid: int) -> int:
        """Bytes ``pid`` had sent during a blackhole that reached the router after it."""
        with self._lock:
            return sum(link.late_bytes for link in self._links if link.pid == pid)

    def blackhole(self, pid: int, seconds: float) -> None:
        """Stop every byte to and from ``pid``'s links for ``seconds``; nothing is closed (module doc)."""
        with self._lock:
            self._cut[pid] = (time.monotonic() + seconds, "blackhole")

    def sever(self, pid: int, seconds: float) -> None:
        """Reset ``pid``'s links now and refuse its reconnects for ``seconds`` (module doc)."""
        with self._lock:
            self._cut[pid] = (time.monotonic() + seconds, "sever")
            links = [link for link in self._links if link.pid == pid]
        for link in links:
            link.close(reset=True)

    def _cut_for(self, pid: int | None) -> tuple[float, str] | None:
        """The cut on ``pid`` still in force (until, mode), or None."""
        if pid is None:
            return None
        with self._lock:
            cut = self._cut.get(pid)
            if cut is not None and cut[0] <= time.monotonic():
                del self._cut[pid]
                cut = None
        return cut

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            links = list(self._links)
        for link in links:
            link.close()

    # ---- relaying ---------------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                down, peer = self._listener.accept()
            except OSError:
                return
            pid = _pid_of(peer)
            cut = self._cut_for(pid)
            if cut is not None and cut[1] == "sever":
                _reset(down)  # refused: the worker retries until the window ends
                continue
            with self._lock:
                self._accepted[pid] = self._accepted.get(pid, 0) + 1
            try:
                up = socket.create_connection(self.target, timeout=10)
            except OSError:
                _reset(down)
                continue
            up.settimeout(None)
            for s in (down, up):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            link = _Link(pid, down, up)
            with self._lock:
                self._links.append(link)
            threading.Thread(target=self._pump, args=(link, down, up, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(link, up, down, False), daemon=True).start()

    def _pump(self, link: _Link, src: socket.socket, dst: socket.socket, from_worker: bool) -> None:
        held: list[bytes] = []  # read during a blackhole: in the network, delivered when it ends
        late = 0  # of which read while the window lasted
        eof = False
        try:
            while not link.closed.is_set() and not self._stop.is_set():
                cut = self._cut_for(link.pid)
                if cut is None and held:  # NOTE: in order: nothing read later may overtake what was held
                    data, held = b"".join(held), []
                    if from_worker:  # NOTE: counted before it is sent on, so before any answer to it
                        with self._lock:
                            link.late_bytes += late
                    late = 0
                    dst.sendall(data)
                if eof:
                    if cut is None:
                        break
                    time.sleep(min(_POLL_S, max(cut[0] - time.monotonic(), 0.0)))
                    continue
                readable, _, _ = select.select([src], [], [], _POLL_S)
                if not readable:
                    continue
                try:
                    data = src.recv(_CHUNK)
                except OSError:  # NOTE: reset (a killed process): what is held still goes on
                    data = b""
                if not data:
                    eof = True
                    continue
                if self._cut_for(link.pid) is not None or held:  # cut while waiting, or not yet flushed
                    held.append(data)
                    late += len(data) if self._cut_for(link.pid) is not None else 0
                    continue
                dst.sendall(data)
        except (OSError, ValueError):  # NOTE: ValueError: the other direction closed the socket (fd -1) mid-select
            pass
        finally:
            link.direction_ended(dst)
