"""A request's block-table mirror follows every way the scheduler changes a table: extended in place, replaced by
another list (preemption, swap-in, prefix hits), replaced by a shorter or same-length one."""

import random

import numpy as np

from kvserve.workers.engine.table_mirror import TableMirror


def test_the_mirror_equals_the_list_through_extends_and_replacements() -> None:
    rng = random.Random(0)
    mirror, table = TableMirror(), []
    for _ in range(2000):
        op = rng.random()
        if op < 0.7:
            table.extend(rng.randrange(10_000) for _ in range(rng.randrange(0, 3)))
        elif op < 0.8:  # a same-length replacement (e.g. swapped out and in again to other blocks)
            table = [rng.randrange(10_000) for _ in table]
        elif op < 0.9:
            table = table[: rng.randrange(len(table) + 1)] + [rng.randrange(10_000)]
        else:
            table = []
        view = mirror.view(table)
        assert view.dtype == np.int64 and view.tolist() == table


def test_an_extension_converts_only_the_new_entries() -> None:
    mirror, table = TableMirror(), list(range(100))
    mirror.view(table)
    table[0] = -1  # NOTE: breaks the contract on purpose: an edit in place is not seen, an extension is
    table.append(100)
    assert mirror.view(table).tolist() == [0, *range(1, 101)]
