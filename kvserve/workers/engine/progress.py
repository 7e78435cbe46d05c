"""A rich progress bar over finished requests, on stderr (offline generation, benchmarks)."""

from __future__ import annotations

from collections.abc import Callable


class RequestProgress:
    """``with RequestProgress(total, enabled, label) as advance:`` call ``advance()`` per finished request.

    Disabled, it draws nothing and ``advance`` does nothing (rich is not even imported).
    """

    def __init__(self, total: int, enabled: bool, label: str) -> None:
        self.total, self.enabled, self.label = total, enabled, label

    def __enter__(self) -> Callable[[], None]:
        if not self.enabled:
            return lambda: None
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        self._bar = Progress(
            self.label, BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=Console(stderr=True)
        )
        self._bar.start()
        task = self._bar.add_task("requests", total=self.total)
        return lambda: self._bar.advance(task)

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self._bar.stop()
