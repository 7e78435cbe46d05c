"""Many requests on one client stream (``KVServe.GenerateStream``): what the router delivers for them is
gathered into one ``GenerateBatch`` per wake-up of the stream's writer, i.e. one message per worker
step instead of one per request (the client unbatches by request id).

Each request's ``responses`` is a ``MuxSlot``: the router puts into it as into a request's own queue
(router/router.py does not know the difference), and the slot forwards to the stream's ``StreamMux``.
Responses arrive as their fields (router/demux.py ``ResponseFields``) and the batch is built from
them in one constructor call. Consecutive responses of one request from one worker merge
(``merge_fields``), so a batch holds one response per request and worker; ``qsize`` counts what
the client has not been sent yet, which is what the router's slow-consumer rule
(``max_buffered_responses``) reads.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, MutableMapping
from typing import Any

from protos.kvserve.v1 import serving_pb2 as spb
from router.demux import ResponseFields, merge_fields
from router.request import RouterError


class StreamMux:
    """The pending output of one GenerateStream: a batch to send, filled by its requests' slots."""

    def __init__(self) -> None:
        self._responses: list[ResponseFields] = []
        self._last: dict[str, int] = {}  # request id -> index of its last response in the batch
        self._errors: list[spb.RequestError] = []
        self._unsent: dict[str, int] = {}  # request id -> puts since the last batch went out
        self._ready = asyncio.Event()

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

    def unsent(self, request_id: str) -> int:
        return self._unsent.get(request_id, 0)

    def drop(self, request_id: str) -> None:
        """Forget what ``request_id`` has not been sent (the router dropped a slow consumer's backlog)."""
        self._responses = [r for r in self._responses if r["request_id"] != request_id]
        self._last = {r["request_id"]: i for i, r in enumerate(self._responses)}
        self._unsent.pop(request_id, None)

    def wake(self) -> None:
        """Wake the writer with nothing new (it then checks whether the stream is over)."""
        self._ready.set()

    async def next_batch(self) -> spb.GenerateBatch:
        """Wait until something is pending, then take all of it."""
        await self._ready.wait()
        return self.take()

    def take(self) -> spb.GenerateBatch:
        batch = spb.GenerateBatch(responses=self._responses, errors=self._errors)
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
        for resp in batch.responses:
            if resp.finish_reason:
                live.pop(resp.request_id, None)
        for err in batch.errors:
            live.pop(err.request_id, None)
        if batch.responses or batch.errors:
            yield batch
        if reader.done():
            reader.result()
            if not live:
                return
