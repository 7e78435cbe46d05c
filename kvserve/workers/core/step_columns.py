"""A step's plain outputs as columns (``DecodeColumns``) and back, for both ends of WorkerLink.

A worker sends the outputs that carry only tokens and text as columns (kvserve/workers/transport/worker.py
``_step_outputs``); the router reads them in its fast path (kvserve/router/requests/router.py ``_on_columns``) and
turns an entry back into a ``RequestOutput`` only where it needs the general path (a first token,
an output out of order, a request on a stream without columns). The worker's outbox does the same
for an entry it folds into an earlier step's output (kvserve/workers/transport/outbox.py ``_merge_outputs``).
"""

from __future__ import annotations

from collections.abc import Iterator

from kvserve.protos.kvserve.v1 import worker_pb2 as pb


def column_entries(cols: pb.DecodeColumns) -> Iterator[tuple[str, list[int], int, str]]:
    """``(request_id, new_token_ids, num_output_tokens, text_delta)`` per entry, in order."""
    tokens = list(cols.token_ids)
    at = 0
    for rid, n, total, text in zip(cols.request_ids, cols.counts, cols.num_output_tokens, cols.text_deltas,
                                   strict=True):  # fmt: skip
        yield rid, tokens[at : at + n], total, text
        at += n


def entry_output(rid: str, new: list[int], total: int, text: str) -> pb.RequestOutput:
    """One column entry as the ``RequestOutput`` it stands for."""
    return pb.RequestOutput(request_id=rid, new_token_ids=new, num_output_tokens=total, text_delta=text)


def append_entry(cols: pb.DecodeColumns, rid: str, new: list[int], total: int, text: str) -> None:
    """Add one plain output to ``cols`` (a worker with many builds the columns at once instead)."""
    cols.request_ids.append(rid)
    cols.counts.append(len(new))
    cols.token_ids.extend(new)
    cols.num_output_tokens.append(total)
    cols.text_deltas.append(text)
