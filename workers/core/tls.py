"""PEM files for the router's and the workers' TLS (the one reader of them)."""

from __future__ import annotations

from pathlib import Path


def read_pem(path: str | None) -> bytes | None:
    """The bytes of a PEM file, or None for no path (the one PEM reader: router and worker TLS)."""
    return Path(path).read_bytes() if path else None
