"""A step's plain outputs (kvserve/workers/core/step_columns.py) to their streams: the data plane's fast path.

An entry is delivered here when ``demux.next_in_order`` holds for it (the in-order rule, written once,
in kvserve/router/requests/demux.py) and its stream has room under ``max_buffered_responses``: the
tokens go to the request's stream as a column entry where its client reads them
(kvserve/router/requests/mux.py ``put_plain``), else as a response. Any other entry takes the general
path (``fallback``) as the ``RequestOutput`` it stands for, so every other rule (ordering,
de-duplication, strays, slow consumers, first-token timing) stays in the demux.
"""

from __future__ import annotations

from collections.abc import Callable

from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.router.requests.demux import advance, next_in_order
from kvserve.router.requests.pipeline import RequestPipeline
from kvserve.workers.core.step_columns import column_entries, entry_output


def deliver_columns(
    router: RequestPipeline,
    worker_id: str,
    cols: pb.DecodeColumns,
    now: float,
    fallback: Callable[[str, pb.RequestOutput, float], None],
) -> None:
    """Deliver ``cols`` from ``worker_id``; entries off the fast path go to ``fallback``."""
    current = router.dispatcher.by_worker_rid
    entry = router.table.get(worker_id)
    in_flight, started = (entry.in_flight, entry.started) if entry is not None else ({}, set())
    limit = router.config.max_buffered_responses
    itls: list[float] = []
    streamed = 0
    for rid, new, total, text in column_entries(cols):
        n = len(new)
        r = current.get(rid)
        if r is None or not next_in_order(r, worker_id, total, n):
            fallback(worker_id, entry_output(rid, new, total, text), now)
            continue
        mux = r.columns
        if (mux.unsent(r.request_id) if mux is not None else r.responses.qsize()) >= limit:
            fallback(worker_id, entry_output(rid, new, total, text), now)
            continue
        if rid in in_flight:
            started.add(rid)
        itls.append(advance(r, new, now)[1])
        streamed += n
        if mux is not None:
            mux.put_plain(worker_id, r.request_id, new, text)
        else:
            r.responses.put_nowait({"request_id": r.request_id, "token_ids": new, "text_delta": text,
                                    "worker_id": worker_id})  # fmt: skip
    router.metrics.streamed_plain(itls, streamed)
