"""BlockStore: one tier of the tiered prefix cache, a directory of per-block files (docs/architecture.md §3a).

The host tier (a directory in ``/dev/shm``, shared by every worker on the node) and the disk tier
(``--disk-cache-dir``) are the same format and the same class; only the directory and the byte
budget differ.

File format, one file per block, named ``<layout fingerprint>-<block hash>.kvb`` (16 hex digits each)::

    header  magic "KVSBLK01" | version u32 | block hash u64 | layout digest (32 bytes) |
            payload length u64 | payload crc32 u32                      (little-endian)
    payload the block's KV, all layers contiguous (see ``kvserve/workers/engine/tiered_cache.py``)

The layout digest is sha256 of the layout string: the model id, layer count, block shape and dtype;
the fingerprint in the name is its first 8 bytes. A block's name thus belongs to one layout, so models
and KV dtypes share a directory (and its byte budget) without ever claiming each other's names: a
block of one layout is never shadowed by another layout's file of the same hash. (Names were the bare
hash before; such a file is never served, only swept by the LRU.) A file whose header or checksum
does not match what a reader expects is never served and is removed (torn, corrupt, or renamed).

Contracts:
  * writes are atomic: a temporary file in the same directory, then ``os.replace``; a reader sees
    either no file or a whole one, and a crash leaves at most a stale temporary (swept later);
  * LRU within a byte budget, across processes: a file's mtime is its last use (``put`` writes it,
    ``get`` touches it); ``evict_to_budget`` removes the oldest files until the directory fits,
    handing each to the next tier first (``demote_to``). The state is the directory itself, so any
    number of workers on a node share one budget without talking to each other;
  * "not there" is ``None``/``False``; a broken rule (a payload of the wrong size) raises.

Stdlib only (no torch): the payload is opaque bytes here.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import struct
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

MAGIC = b"KVSBLK01"
VERSION = 1
_HEADER = struct.Struct("<8sIQ32sQI")
HEADER_BYTES = _HEADER.size
SUFFIX = ".kvb"
_TMP_PREFIX = ".tmp-"
_STALE_TMP_S = 60.0  # a temporary older than this belongs to a writer that died


def layout_digest(layout: str) -> bytes:
    """The 32-byte digest a file's header carries for its layout string."""
    return hashlib.sha256(layout.encode()).digest()


@dataclass
class Eviction:
    """What one ``evict_to_budget`` sweep did: hashes removed from this tier, and of those, the ones
    now in the next tier."""

    removed: list[int] = field(default_factory=list)
    demoted: list[int] = field(default_factory=list)


class BlockStore:
    """Per-block files in one directory, LRU within ``capacity_bytes`` (header + payload per file).

    Args:
        directory: created if missing.
        capacity_bytes: the byte budget of the directory (every process writing it shares it).
        layout: the layout string (model id, layers, shape, dtype); files of another layout are misses.
        payload_bytes: the size of every block's payload in this layout.
        name: the tier's name in events and metrics ("host", "disk").
        demote_to: the next tier; blocks leaving this one are written there first.

    Raises:
        ValueError: a budget that cannot hold one block.
    """

    def __init__(
        self,
        directory: str | Path,
        capacity_bytes: int,
        layout: str,
        payload_bytes: int,
        name: str,
        demote_to: BlockStore | None = None,
    ) -> None:
        self.file_bytes = HEADER_BYTES + payload_bytes
        if capacity_bytes < self.file_bytes:
            raise ValueError(f"{name} tier budget {capacity_bytes} B cannot hold one {self.file_bytes} B block")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.layout = layout
        self.digest = layout_digest(layout)
        self.fingerprint = self.digest[:8].hex()
        self.payload_bytes = payload_bytes
        self.name = name
        self.demote_to = demote_to
        self.num_rejected = 0  # files found torn, corrupt or of another layout (never served)

    # ---- names ---------------------------------------------------------------------------
    def path(self, block_hash: int) -> Path:
        return self.directory / self.file_name(block_hash)

    def file_name(self, block_hash: int) -> str:
        """``<layout fingerprint>-<hash>.kvb``: the name is this layout's alone."""
        return f"{self.fingerprint}-{block_hash:016x}{SUFFIX}"

    def contains(self, block_hash: int) -> bool:
        """Whether a file for the hash exists (not yet verified: ``get`` checks it)."""
        return self.path(block_hash).exists()

    # ---- write ---------------------------------------------------------------------------
    def encode(self, block_hash: int, payload: bytes | memoryview) -> bytes:
        """Header + payload, the bytes of one file."""
        if len(payload) != self.payload_bytes:
            raise ValueError(f"payload of {len(payload)} B, this layout's blocks have {self.payload_bytes} B")
        header = _HEADER.pack(MAGIC, VERSION, block_hash, self.digest, len(payload), zlib.crc32(payload))
        return header + bytes(payload)

    def put(self, block_hash: int, payload: bytes | memoryview) -> bool:
        """Store one block atomically. False if it was already there (its recency is refreshed)."""
        if self.touch(block_hash):
            return False
        self._write_file(block_hash, self.encode(block_hash, payload))
        return True

    def _write_file(self, block_hash: int, data: bytes, name: str | None = None) -> None:
        """Write ``data`` atomically under ``name`` (default: this layout's name of the hash)."""
        tmp = self.directory / f"{_TMP_PREFIX}{os.getpid()}-{block_hash:016x}-{time.monotonic_ns()}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, self.directory / (name or self.file_name(block_hash)))
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise

    def touch(self, block_hash: int) -> bool:
        """Make the block most recently used. False if it is not here."""
        try:
            os.utime(self.path(block_hash))
            return True
        except FileNotFoundError:
            return False

    # ---- read ----------------------------------------------------------------------------
    def get(self, block_hash: int) -> bytes | None:
        """The block's payload, verified (header and checksum), or None. A hit becomes most recent."""
        path = self.path(block_hash)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        payload = self._verified_payload(block_hash, data, path)
        if payload is not None:
            with contextlib.suppress(FileNotFoundError):
                os.utime(path)
        return payload

    def _verified_payload(self, block_hash: int, data: bytes, path: Path, remove_bad: bool = True) -> bytes | None:
        """The payload if the header and checksum match this layout; else None (the file is removed
        when ``remove_bad``: under this layout's name, a file of another digest is not anyone's block)."""
        payload = _intact_payload(block_hash, data)
        if payload is None or _HEADER.unpack_from(data)[3] != self.digest or len(payload) != self.payload_bytes:
            return self._reject(path, remove_bad)
        return payload

    def _reject(self, path: Path, remove: bool) -> None:
        self.num_rejected += 1
        if remove:
            with contextlib.suppress(OSError):
                path.unlink()
        return None

    # ---- LRU -----------------------------------------------------------------------------
    def _entries(self) -> Iterator[tuple[str, int, float, int, Path]]:
        """(fingerprint, hash, mtime, size, path) of every block file of every layout (fingerprint ""
        for a file of the old, bare-hash naming); stale temporaries are removed on the way."""
        now = time.time()
        with os.scandir(self.directory) as it:
            for entry in it:
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue  # another process evicted it meanwhile
                if entry.name.startswith(_TMP_PREFIX):
                    if now - st.st_mtime > _STALE_TMP_S:
                        with contextlib.suppress(OSError):
                            os.unlink(entry.path)
                    continue
                if not entry.name.endswith(SUFFIX):
                    continue
                fingerprint, _, hex_hash = entry.name[: -len(SUFFIX)].rpartition("-")
                try:
                    h = int(hex_hash, 16)
                except ValueError:
                    continue
                yield fingerprint, h, st.st_mtime, st.st_size, Path(entry.path)

    def hashes(self) -> list[int]:
        """Every block hash with a file of this layout here (the tier's snapshot for the router)."""
        return [h for fp, h, _, _, _ in self._entries() if fp == self.fingerprint]

    def used_bytes(self) -> int:
        """Bytes of every layout's files: the directory's budget is one, whoever shares it."""
        return sum(size for _, _, _, size, _ in self._entries())

    def evict_to_budget(self) -> Eviction:
        """Remove least recently used files until the directory fits its budget, demoting each.

        Sweeps of several processes are serialised by a lock file, so two of them do not both
        demote the same victims; a file another process removed meanwhile is skipped. Every layout's
        files compete in one LRU (one budget per directory) and are demoted under their own names;
        ``Eviction`` lists only this layout's hashes (the ones this worker's router knows of).
        """
        out = Eviction()
        with open(self.directory / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            entries = sorted(self._entries(), key=lambda e: e[2])
            used = sum(e[3] for e in entries)
            for fp, h, _, size, path in entries:
                if used <= self.capacity_bytes:
                    break
                used -= size
                ours = fp == self.fingerprint
                if self.demote_to is not None and fp and self._demote(h, path) and ours:
                    out.demoted.append(h)
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    if ours:
                        out.removed.append(h)
        return out

    def _demote(self, block_hash: int, path: Path) -> bool:
        """Copy an intact file (any layout's) to the next tier under its own name, as is (the same
        format). False if it was not intact."""
        assert self.demote_to is not None
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return False
        if _intact_payload(block_hash, data) is None:
            return False  # the sweep removes it
        with contextlib.suppress(FileNotFoundError):
            os.utime(self.demote_to.directory / path.name)
            return True
        self.demote_to._write_file(block_hash, data, name=path.name)
        return True


def _intact_payload(block_hash: int, data: bytes) -> bytes | None:
    """The payload of a whole block file of ``block_hash`` (magic, version, hash, length and checksum
    as its header says), whatever its layout; None if it is torn, corrupt or another block's."""
    if len(data) < HEADER_BYTES:
        return None
    magic, version, h, _, length, crc = _HEADER.unpack_from(data)
    payload = data[HEADER_BYTES:]
    if magic != MAGIC or version != VERSION or h != block_hash or len(payload) != length:
        return None
    return payload if zlib.crc32(payload) == crc else None
