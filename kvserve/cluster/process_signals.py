"""Signals of the long-running CLI processes (``kvserve serve``, ``kvserve demo``): Ctrl-C and SIGTERM
stop the cluster cleanly, and a second one cannot interrupt the shutdown."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def signals_as_keyboard_interrupt() -> Iterator[Callable[[], None]]:
    """SIGTERM behaves like SIGINT (KeyboardInterrupt) inside the block; the old handlers come back after.

    Yields ``reinstall``: call it after ``ray.init``. NOTE: Ray's core worker installs its own
    (C++) SIGTERM handler, which would end the process at once, leaving the actors unstopped.
    """

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    def install() -> None:
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, interrupt)

    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    install()
    try:
        yield install
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


@contextmanager
def signals_ignored() -> Iterator[None]:
    """Shutdown must finish: a second Ctrl-C must not leave half-stopped actors behind."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in saved:
        signal.signal(s, signal.SIG_IGN)
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def stop_all(cluster: Any, started_ray: bool) -> None:
    """Stop the cluster, then the Ray this process started; signals are held off meanwhile."""
    import ray

    with signals_ignored():
        if cluster is not None:
            cluster.shutdown()
        if started_ray and ray.is_initialized():
            ray.shutdown()
