"""Test doubles of the admission tests: a request record and a settable clock."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Item:
    request_id: str
    num_blocks: int = 1
    priority: int = 0


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t
