"""The router's record of one request, and the error that ends one with a gRPC status."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.workers.core.sampling_params import SamplingParams

# A worker's state at the router (ClusterStatus.workers[].state).
WORKER_UP, WORKER_DOWN, WORKER_RETIRED = "up", "down", "retired"
# Shown (status only) while a drain runs, from its start until the restarted process is back; the
# table's own state stays up/down underneath (kvserve/router/requests/drain.py).
WORKER_DRAINING = "draining"


class RouterError(Exception):
    """A request refused or ended with a gRPC status (and optional trailing metadata)."""

    def __init__(self, code: grpc.StatusCode, message: str, trailers: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.code, self.message, self.trailers = code, message, trailers


class ResponseQueue(asyncio.Queue):
    """A request's own stream: ``GenerateResponse``s, each built from the fields the demux delivers
    (kvserve/router/requests/demux.py ``ResponseFields``), and a final ``RouterError`` if it ends abnormally."""

    def put_nowait(self, item: dict[str, Any] | spb.GenerateResponse | RouterError) -> None:
        super().put_nowait(spb.GenerateResponse(**item) if isinstance(item, dict) else item)


@dataclass(eq=False)
class RouterRequest:
    """One request from ``submit`` to its final response.

    ``worker_id`` is set once a worker accepted it (``target`` while that call is in flight);
    ``responses`` is what ``Router.stream`` yields (GenerateResponse or a final RouterError).
    The output fields (``tokens_received``, ``output_ids``, ``held``, the token times and counts)
    belong to the demux (kvserve/router/requests/demux.py).

    ``worker_rid`` is the id the current dispatch has on its worker (``<request_id>#<dispatch>``):
    every dispatch (first placement, failover replay) gets a new one, so outputs of an earlier
    dispatch (a dead worker's, an aborted one's) are told apart and dropped, and a finished
    request's id is free for a new request at once.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int
    tenant: str
    block_hashes: tuple[int, ...]
    num_blocks: int  # prompt blocks, for queue accounting
    arrival: float = field(default_factory=time.monotonic)
    started_at: float | None = None  # first dispatch (its service time counts from here)
    responses: ResponseQueue | Any = field(default_factory=ResponseQueue)  # or a MuxSlot (router/requests/mux.py)
    columns: Any = None  # the StreamMux of ``responses`` when its client reads TokenColumns (router/requests/mux.py)
    worker_id: str | None = None
    target: str | None = None  # placement decided, dispatch pending
    tokens_received: int = 0
    output_ids: list[int] = field(default_factory=list)  # tokens delivered to the client (for a replay)
    worker_rid: str = ""
    # Workers whose outputs count for the current dispatch: the one it was sent to, and a
    # migration's destination (from its import on); any other worker's are dropped.
    dispatch_workers: set[str] = field(default_factory=set)
    replays: int = 0  # failover replays (counted in ``migrations`` too)
    finished: bool = False
    cancelled: bool = False
    preemptions: int = 0
    swaps: int = 0
    migrations: int = 0
    router_preempted: bool = False
    held: list[tuple[str, pb.RequestOutput]] = field(default_factory=list)  # outputs past a gap
    first_token_time: float | None = None
    last_token_time: float | None = None
    # Owned (docs/architecture.md section 2a): its outputs go to the frontend at ``owner`` (its data service),
    # which knows it as ``owner_key``; the router gets its progress only (kvserve/router/requests/owned.py).
    owner: str = ""
    owner_key: str = ""
    # Its ``ResumeGrant`` (kvserve/router/requests/takeover.py): a client may resume it through another frontend.
    resume: Any = None
