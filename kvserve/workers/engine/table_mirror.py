"""A request's block table as a numpy array, kept across steps so a step copies it row by row in C.

Building each step's block tables from Python lists cost ~1.3 ms at batch 256 (contexts 200-4096, block 16;
Zen 4): a list-to-array conversion per row, every step, for tables that grow by one block every 16 tokens.
The mirror converts only what was appended since the last step.

Contract (kvserve/workers/engine/scheduler.py keeps it): a request's ``block_table`` list is only ever extended
in place or replaced by another list object, never edited in place. A replaced or shorter list is mirrored
afresh.
"""

from __future__ import annotations

import numpy as np


class TableMirror:
    """The int64 mirror of one request's ``block_table`` (``view``)."""

    __slots__ = ("_array", "_length", "_source")

    def __init__(self) -> None:
        self._source: list[int] | None = None
        self._array = np.empty(0, dtype=np.int64)
        self._length = 0

    def view(self, table: list[int]) -> np.ndarray:
        """``table`` as an int64 array (a view valid until the next call)."""
        n = len(table)
        if table is not self._source or n < self._length:
            self._source, self._length = table, 0
        if n > self._length:
            if n > len(self._array):
                grown = np.empty(max(n, 2 * len(self._array), 16), dtype=np.int64)
                grown[: self._length] = self._array[: self._length]
                self._array = grown
            self._array[self._length : n] = table[self._length : n]
            self._length = n
        return self._array[:n]


class TableRows:
    """The host side of a persistent ``[rows, width]`` device block table whose rows requests keep across steps
    (the decode graphs' table, ``input_buffers.DecodeBuffers``; vLLM V1's persistent BlockTable is the model).

    ``host`` is the device table's exact twin, plus a last row of zeros (``pad_row``) that padding rows read. A
    row mirrors one ``block_table`` list object (the contract above: extended in place, or replaced by another
    list), so the list's identity is the key. ``assign`` gives each table of a batch its row and returns the
    entries to write on the device: those appended since the row was last written; a whole row, zeros past the
    table included, for a table new to its row (a recycled row is fully rewritten before it is read). A replaced
    table gets a new row; that row, like the row of a request that left (finished, preempted, aborted,
    exported), is reclaimed when a row is needed: the least recently used one that no table of the batch holds.
    Rows never leak (there are ``rows`` of them, at least a batch's worth) and entries past a row's table are
    zero, so a row reads exactly as the zero-padded dense table row would.

    NOTE: a row keeps its list alive until the row is reclaimed, so ``id(table)`` cannot be reused meanwhile.
    """

    __slots__ = ("_lengths", "_row_of", "_step", "_tables", "_used", "host", "pad_row", "rows", "width")

    def __init__(self, rows: int, width: int) -> None:
        self.rows, self.width, self.pad_row = rows, width, rows
        self.host = np.zeros((rows + 1, width), dtype=np.int32)
        self._tables: list[list[int] | None] = [None] * rows  # the list each row mirrors
        self._lengths = np.zeros(rows, dtype=np.int64)  # entries written (the rest of the row is zero)
        self._used = np.full(rows, -1, dtype=np.int64)  # the last step that read each row
        self._row_of: dict[int, int] = {}  # id(table) -> row
        self._step = 0

    def assign(self, tables: list[list[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows for one batch's tables (``len(tables) <= rows``, distinct lists). Returns the row of each table
        (int64), then the entries to write: flat indices into the ``[rows + 1, width]`` table (int64) and their
        values (int32), at most one span of columns per row (no index twice)."""
        self._step = step = self._step + 1
        num = len(tables)
        assert num <= self.rows, (num, self.rows)
        get, w, host = self._row_of.get, self.width, self.host
        rows = np.fromiter([get(id(t), -1) for t in tables], dtype=np.int64, count=num)
        hit = rows >= 0
        self._used[rows[hit]] = step  # before any reclaim: no row of this batch is taken
        spans: list[tuple[int, int, int]] = []  # (row, first column, end column) to write
        for j in np.flatnonzero(~hit).tolist():
            table, r = tables[j], self._reclaim()
            rows[j], self._used[r] = r, step
            self._tables[r], self._row_of[id(table)] = table, r
            n, old = min(len(table), w), int(self._lengths[r])
            host[r, :n] = table[:n]
            host[r, n:old] = 0
            spans.append((r, 0, max(n, old)))
            self._lengths[r] = n
        lens = np.fromiter(map(len, tables), dtype=np.int64, count=num)
        np.minimum(lens, w, out=lens)
        for j in np.flatnonzero(lens != self._lengths[rows]).tolist():
            r, n, table = int(rows[j]), int(lens[j]), tables[j]
            old = int(self._lengths[r])
            if n > old:  # extended in place: the new entries
                host[r, old:n] = table[old:n]
                spans.append((r, old, n))
            else:  # NOTE: shorter, so edited in place (outside the contract): rewrite the row
                host[r, :n] = table[:n]
                host[r, n:old] = 0
                spans.append((r, 0, old))
            self._lengths[r] = n
        if not spans:
            return rows, np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int32)
        r_, a, e = np.array(spans, dtype=np.int64).T
        counts = e - a
        total = int(counts.sum())
        flat = np.repeat(r_ * w + a - (np.cumsum(counts) - counts), counts) + np.arange(total)
        return rows, flat, host.reshape(-1)[flat]

    def _reclaim(self) -> int:
        """A row for a table new to the table: one never used, else the least recently used one (not this step's)."""
        r = int(np.argmin(self._used))
        assert self._used[r] < self._step, "every row is read by this step"
        old = self._tables[r]
        if old is not None:
            del self._row_of[id(old)]
            self._tables[r] = None
        return r

    def row_tables(self) -> list[list[int] | None]:
        """The list each row mirrors (None: never assigned), for tests."""
        return list(self._tables)
