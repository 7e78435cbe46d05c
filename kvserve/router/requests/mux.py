"""Many requests on one client stream (``KVServe.GenerateStream``): what the router delivers for them is
gathered into one ``GenerateBatch`` per wake-up of the stream's writer, i.e. one message per worker
step instead of one per request (the client unbatches by request id).

Each request's ``responses`` is a ``MuxSlot``: the router puts into it as into a request's own queue
(kvserve/router/requests/router.py does not know the difference), and the slot forwards to the stream's ``StreamMux``.
Responses arrive as their fields (kvserve/router/requests/demux.py ``ResponseFields``) and the batch is built from
them in one constructor call. Consecutive responses of one request from one worker merge
(``merge_fields``), so a batch holds one response per request and worker; ``qsize`` counts what
the client has not been sent yet, which is what the router's slow-consumer rule
(``max_buffered_responses``) reads.

A stream whose client reads ``TokenColumns`` (it said ``token_columns``) also takes plain decode
tokens (``put_plain``: no finish, no logprobs) as columns: one entry per request per step appended
to five lists, and the batch's columns built from them in one call, instead of a response message
per request. Order: the client reads the columns before the responses, so a request that already
has a response in the batch gets its later tokens appended to that response, never a column entry.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator, MutableMapping
from typing import Any

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.router.requests.demux import ResponseFields, merge_fields
from kvserve.router.requests.request import RouterError


class StreamMux:
    """The pending output of one GenerateStream: a batch to send, filled by its requests' slots."""

    def __init__(self, columns: bool = False) -> None:
        self.columns = columns  # the client reads TokenColumns (put_plain may be used)
        self._responses: list[ResponseFields] = []
        self._last: dict[str, int] = {}  # request id -> index of its last response in the batch
        self._errors: list[spb.RequestError] = []
        self._unsent: dict[str, int] = {}  # request id -> puts since the last batch went out
        self._placed: list[str] = []  # owner keys placed (kvserve/router/requests/owned.py)
        self._replays: list[str] = []  # owner keys whose owner must answer with a Resume
        self.ended_silently: list[str] = []  # owned requests that ended with no response (their owner had it)
        self._ready = asyncio.Event()
        self._clear_columns()

    def _clear_columns(self) -> None:
        self._col_workers: dict[str, int] = {}  # worker id -> its index in the batch's worker_ids
        self._col_worker: list[int] = []
        self._col_rids: list[str] = []
        self._col_counts: list[int] = []
        self._col_tokens: list[int] = []
        self._col_texts: list[str] = []

    def slot(self, request_id: str) -> MuxSlot:
        return MuxSlot(self, request_id)

    def put(self, request_id: str, item: ResponseFields | RouterError) -> None:
        self._unsent[request_id] = self._unsent.get(request_id, 0) + 1
        if isinstance(item, RouterError):
            self._errors.append(error_message(request_id, item))
        else:
            i = self._last.get(request_id)
            prev = self._responses[i] if i is not None else None
            if prev is not None and "finish_reason" not in prev and prev["worker_id"] == item["worker_id"]:
                merge_fields(prev, item)
            else:
                self._last[request_id] = len(self._responses)
                self._responses.append(item)
        self._ready.set()

    def put_plain(self, worker_id: str, request_id: str, token_ids: list[int], text_delta: str) -> None:
        """A plain decode response (as ``put`` of its fields, but as a column entry where it can be)."""
        if request_id in self._last:  # NOTE: it has a response in this batch, which the client reads after the columns
            self.put(request_id, {"request_id": request_id, "token_ids": token_ids, "text_delta": text_delta,
                                  "worker_id": worker_id})  # fmt: skip
            return
        self._unsent[request_id] = self._unsent.get(request_id, 0) + 1
        w = self._col_workers.get(worker_id)
        if w is None:
            w = self._col_workers[worker_id] = len(self._col_workers)
        self._col_worker.append(w)
        self._col_rids.append(request_id)
        self._col_counts.append(len(token_ids))
        self._col_tokens.extend(token_ids)
        self._col_texts.append(text_delta)
        self._ready.set()

    def unsent(self, request_id: str) -> int:
        return self._unsent.get(request_id, 0)

    def drop(self, request_id: str) -> None:
        """Forget what ``request_id`` has not been sent (the router dropped a slow consumer's backlog)."""
        self._responses = [r for r in self._responses if r["request_id"] != request_id]
        self._last = {r["request_id"]: i for i, r in enumerate(self._responses)}
        self._unsent.pop(request_id, None)
        if request_id in self._col_rids:
            self._drop_columns(request_id)

    def _drop_columns(self, request_id: str) -> None:
        workers, rids, counts, tokens, texts = [], [], [], [], []
        at = 0
        for w, rid, n, text in zip(self._col_worker, self._col_rids, self._col_counts, self._col_texts, strict=True):
            if rid != request_id:
                workers.append(w)
                rids.append(rid)
                counts.append(n)
                tokens.extend(self._col_tokens[at : at + n])
                texts.append(text)
            at += n
        self._col_worker, self._col_rids, self._col_counts = workers, rids, counts
        self._col_tokens, self._col_texts = tokens, texts

    def placed(self, owner_key: str) -> None:
        """An owned request is on a worker (``GenerateBatch.placed``)."""
        self._placed.append(owner_key)
        self._ready.set()

    def replay(self, owner_key: str) -> None:
        """Ask the owner for an owned request's delivered tokens (``GenerateBatch.replays``)."""
        self._replays.append(owner_key)
        self._ready.set()

    def ended(self, request_id: str) -> None:
        """An owned request ended without a response here: it leaves the stream's live requests."""
        self.ended_silently.append(request_id)
        self._ready.set()

    def wake(self) -> None:
        """Wake the writer with nothing new (it then checks whether the stream is over)."""
        self._ready.set()

    async def next_batch(self) -> spb.GenerateBatch:
        """Wait until something is pending, then take all of it."""
        await self._ready.wait()
        return self.take()

    def take(self) -> spb.GenerateBatch:
        batch = spb.GenerateBatch(responses=self._responses, errors=self._errors, placed=self._placed,
                                  replays=self._replays)  # fmt: skip
        self._placed, self._replays = [], []
        if self._col_rids:
            batch.columns.worker_ids.extend(self._col_workers)
            batch.columns.workers.extend(self._col_worker)
            batch.columns.request_ids.extend(self._col_rids)
            batch.columns.counts.extend(self._col_counts)
            batch.columns.token_ids.extend(self._col_tokens)
            batch.columns.text_deltas.extend(self._col_texts)
            self._clear_columns()
        self._responses, self._errors, self._last, self._unsent = [], [], {}, {}
        self._ready.clear()
        return batch


class MuxSlot:
    """A request's ``responses`` on a multiplexed stream (the subset of ``asyncio.Queue`` the router uses)."""

    def __init__(self, mux: StreamMux, request_id: str) -> None:
        self.mux, self.request_id = mux, request_id

    def put_nowait(self, item: ResponseFields | RouterError) -> None:
        self.mux.put(self.request_id, item)

    def qsize(self) -> int:
        return self.mux.unsent(self.request_id)

    def empty(self) -> bool:
        return self.qsize() == 0

    def get_nowait(self) -> None:
        """Drop everything not yet sent (the router's slow-consumer path drains the queue this way)."""
        self.mux.drop(self.request_id)


def column_entries(cols: spb.TokenColumns) -> Iterator[tuple[str, list[int], str, str]]:
    """A batch's columns as ``(request_id, token_ids, text_delta, worker_id)`` per entry, in order
    (a client reads them before the batch's responses)."""
    tokens, names = list(cols.token_ids), list(cols.worker_ids)
    at = 0
    for w, rid, n, text in zip(cols.workers, cols.request_ids, cols.counts, cols.text_deltas, strict=True):
        yield rid, tokens[at : at + n], text, names[w]
        at += n


def batch_responses(batch: spb.GenerateBatch) -> Iterator[spb.GenerateResponse]:
    """Every response of ``batch`` in the order a client must apply them: the columns' entries, then
    the responses (its errors come after both)."""
    for rid, tokens, text, worker_id in column_entries(batch.columns):
        yield spb.GenerateResponse(request_id=rid, token_ids=tokens, text_delta=text, worker_id=worker_id)
    yield from batch.responses


def error_message(request_id: str, e: RouterError) -> spb.RequestError:
    retry = dict(e.trailers).get("retry-after-ms", "0")
    return spb.RequestError(request_id=request_id, code=e.code.value[0], message=e.message, retry_after_ms=int(retry))


async def stream_batches(
    mux: StreamMux, live: MutableMapping[str, Any], reader: asyncio.Task, rename: Callable[[str], str] | None = None
) -> AsyncIterator[spb.GenerateBatch]:
    """A GenerateStream's writer: each batch ``mux`` gathers, until the client closed its side
    (``reader`` done) and none of its requests is ``live`` any more; ``rename`` maps the ids on the
    way out (a tenant's scoped ids). Every request a batch ends leaves ``live``. Re-raises what
    stopped ``reader`` (a bad message: the stream's status)."""
    while True:
        batch = await mux.next_batch()
        if rename is not None:
            for item in (*batch.responses, *batch.errors):
                item.request_id = rename(item.request_id)
            if batch.columns.request_ids:
                batch.columns.request_ids[:] = [rename(rid) for rid in batch.columns.request_ids]
        for resp in batch.responses:
            if resp.finish_reason:
                live.pop(resp.request_id, None)
        for err in batch.errors:
            live.pop(err.request_id, None)
        ended, mux.ended_silently = mux.ended_silently, []
        for rid in ended:
            live.pop(rename(rid) if rename is not None else rid, None)
        if batch.responses or batch.errors or batch.columns.request_ids or batch.placed or batch.replays:
            yield batch
        if reader.done():
            reader.result()
            if not live:
                return
