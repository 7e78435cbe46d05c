"""Server processes for ``kvserve bench compare-serve``: started in their own process group, logged to a
file, waited for over HTTP, and always stopped with everything they started.

``ServerProcess`` runs one command (``kvserve serve``, ``vllm serve``, ``vllm-router``) with
``start_new_session`` so the command and its children (Ray's raylet and actors, vLLM's engine core) can
be signalled as one group. ``stop()`` asks politely first (SIGTERM to the leader: ``kvserve serve``
then stops its actors and its Ray, ``vllm serve`` its engine core), and after a grace period kills the
group and any descendant that left it (Ray starts some of its processes in sessions of their own).
``wait_http_ready`` polls a URL until it answers 200, and fails with a message naming the log file.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

LOG_TAIL_CHARS = 3000


class ServerError(RuntimeError):
    """A server did not come up (exited, or not ready in time); the message names its log file."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the OS picks it; a race with other processes is possible
    but unlikely, and would show as a server that fails to bind, named with its log)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (``/proc``; empty off Linux), children before grandchildren."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])  # after "pid (comm)": state, ppid
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
        children.setdefault(ppid, []).append(int(entry))
    out: list[int] = []
    todo = list(children.get(pid, []))
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo += children.get(p, [])
    return out


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class ServerProcess:
    """One server command in its own process group, stdout and stderr to ``log_path``.

    Use as a context manager, or call ``stop()``: it is idempotent and safe after the process died.
    """

    def __init__(
        self, name: str, argv: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None,
        grace_s: float = 60.0,
    ) -> None:  # fmt: skip
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.grace_s = grace_s
        full_env = dict(os.environ)
        full_env.update(env or {})
        self._log = log_path.open("ab")
        self._log.write(f"$ {' '.join(self.argv)}\n".encode())
        self._log.flush()
        self.proc = subprocess.Popen(
            self.argv, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, env=full_env,
            start_new_session=True,
        )  # fmt: skip
        # Descendants seen while it ran: stop() kills those that outlive the leader, even if they
        # left its process group (Ray daemons) and were re-parented once the leader exited.
        self._seen: set[int] = set()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def running(self) -> bool:
        return self.proc.poll() is None

    def remember_children(self) -> None:
        """Record the current descendants (called while waiting; ``stop()`` calls it too)."""
        if self.running():
            self._seen.update(descendants(self.pid))

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        """The end of the log file (what a failure message shows)."""
        with contextlib.suppress(OSError):
            self._log.flush()
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> int | None:
        """SIGTERM the leader, wait ``grace_s``, then SIGKILL its group and every remembered descendant
        still alive. Returns the leader's exit status (None if it had to be killed)."""
        self.remember_children()
        status = self.proc.poll()
        if status is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                status = self.proc.wait(timeout=self.grace_s)
            except subprocess.TimeoutExpired:
                status = None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        for pid in self._seen:
            if _alive(pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait()
        if not self._log.closed:
            self._log.close()
        return status

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def http_status(url: str, timeout_s: float = 5.0) -> int | None:
    """The HTTP status of GET ``url`` (None: no answer, e.g. connection refused)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (OSError, ValueError):
        return None


def wait_http_ready(
    server: ServerProcess, url: str, timeout_s: float, poll_s: float = 1.0,
    ready: Callable[[], bool] | None = None, clock: Callable[[], float] = time.monotonic,
) -> float:  # fmt: skip
    """Poll ``url`` until it answers 200 (and ``ready()``, if given, is true). Returns the seconds waited.

    Raises:
        ServerError: the server exited, or was not ready within ``timeout_s``; the message names the
            log file and shows its tail.
    """
    t0 = clock()
    while True:
        server.remember_children()
        if not server.running():
            raise ServerError(
                f"{server.name} exited with status {server.proc.returncode} before {url} was ready; "
                f"log {server.log_path}:\n{server.log_tail()}"
            )
        if http_status(url) == 200 and (ready is None or ready()):
            return clock() - t0
        if clock() - t0 > timeout_s:
            raise ServerError(
                f"{server.name} was not ready ({url} answering 200) within {timeout_s:.0f} s; "
                f"log {server.log_path}:\n{server.log_tail()}"
            )
        time.sleep(poll_s)
