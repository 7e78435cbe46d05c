"""The client-facing gRPC surface shared by the router and the frontends (no router state).

* requests whose bytes do not parse become ``Undecodable`` (registered with a deserializer that never
  raises), answered INVALID_ARGUMENT by the method, never UNKNOWN with a class name;
* every method is guarded: an unexpected exception is logged once with its traceback and answered
  INTERNAL with an incident id (the request id when there is one);
* ``read_generate_stream``: the one reading of a ``GenerateStream``'s client side (ids, cancels,
  token columns), whatever then runs the requests (the router's pipeline or a frontend's relay).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from google.protobuf.message import DecodeError, Message

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.router.requests.mux import StreamMux
from kvserve.router.requests.request import RouterError

BATCH_TURN = 64  # a GenerateStream batch's messages read per turn of the router's loop

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Undecodable:
    """Stands in for a request whose bytes did not parse (the method answers INVALID_ARGUMENT)."""

    message_type: str
    error: str


def _lenient_deserializer(message_class: type[Message]) -> Callable[[bytes], Message | Undecodable]:
    """``message_class.FromString`` that returns ``Undecodable`` instead of raising.

    NOTE: a raising deserializer makes grpc answer UNKNOWN with the exception's class name; the
    client sent bad bytes, which is INVALID_ARGUMENT, and the method must be the one to say so.
    """

    def deserialize(data: bytes) -> Message | Undecodable:
        try:
            return message_class.FromString(data)
        except (DecodeError, ValueError, RuntimeError) as e:  # upb raises DecodeError; be generous
            return Undecodable(message_class.DESCRIPTOR.full_name, str(e) or "malformed message")

    return deserialize


async def _reject_undecodable(context: grpc.aio.ServicerContext, request: Undecodable) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"undecodable {request.message_type}: {request.error}")


def _incident_id(request: object) -> str:
    rid = getattr(request, "request_id", "")
    return rid if isinstance(rid, str) and rid else f"incident-{uuid.uuid4().hex[:12]}"


def past_deadline(context: grpc.aio.ServicerContext) -> bool:
    """The call's deadline has passed: grpc ends (or has ended) it DEADLINE_EXCEEDED itself."""
    remaining = context.time_remaining()
    return remaining is not None and remaining <= 0


async def abort_call(context: grpc.aio.ServicerContext, e: RouterError) -> None:
    """End the call with ``e``'s status (and its trailers, e.g. ``retry-after-ms``).

    NOTE: a call whose deadline passed while its handler was busy (a loaded loop, the router's own
    expiry firing as grpc's does) is already over in grpc's core: the abort then fails inside grpc
    (``ExecuteBatchError``), and each failure became a traceback in the router log for what is an
    ordinary expiry. The client has its DEADLINE_EXCEEDED; the handler just returns.
    """
    if e.trailers:
        context.set_trailing_metadata(e.trailers)
    try:
        await context.abort(e.code, e.message)
    except grpc.aio.AbortError:
        raise
    except Exception:
        if not past_deadline(context):
            raise
        logger.debug("call already ended by its deadline; not answered %s", e.code.name)


async def _answer_internal(context: grpc.aio.ServicerContext, method: str, request: object) -> None:
    incident = _incident_id(request)
    if past_deadline(context):  # NOTE: the call is over (abort_call): one line, no INTERNAL to send
        logger.warning("%s (id %s) failed after its deadline passed: %r", method, incident, sys.exc_info()[1])
        return
    logger.exception("%s failed unexpectedly (id %s)", method, incident)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method} (id {incident}); see the router log")


def _guard_unary(method: Callable[..., Any], name: str) -> Callable[..., Any]:
    @functools.wraps(method)
    async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Undecodable):
            await _reject_undecodable(context, request)
        try:
            return await method(request, context)
        except grpc.aio.AbortError:
            raise  # context.abort: the status is already chosen
        except Exception:  # noqa: BLE001 - anything else is our bug: log it, answer INTERNAL
            await _answer_internal(context, name, request)

    return guarded


def _guard_stream(method: Callable[..., AsyncIterator[Any]], name: str) -> Callable[..., AsyncIterator[Any]]:
    @functools.wraps(method)
    async def guarded(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if isinstance(request, Undecodable):
            await _reject_undecodable(context, request)
        try:
            async for response in method(request, context):
                yield response
        except grpc.aio.AbortError:
            raise
        except Exception:  # noqa: BLE001 - see _guard_unary
            await _answer_internal(context, name, request)

    return guarded


def add_kvserve_servicer(servicer: Any, server: grpc.aio.Server, service_name: str = "KVServe") -> None:
    """``add_KVServeServicer_to_server`` (or that of another service of serving.proto, e.g.
    ``Admin``) with lenient deserializers and every method guarded."""
    service = spb.DESCRIPTOR.services_by_name[service_name]
    handlers = {}
    for m in service.methods:
        request_class = getattr(spb, m.input_type.name)
        response_class = getattr(spb, m.output_type.name)
        method = getattr(servicer, m.name)
        if m.client_streaming:
            handler = grpc.stream_stream_rpc_method_handler(
                _guard_stream(method, m.name),
                request_deserializer=_lenient_deserializer(request_class),
                response_serializer=response_class.SerializeToString,
            )
        elif m.server_streaming:
            handler = grpc.unary_stream_rpc_method_handler(
                _guard_stream(method, m.name),
                request_deserializer=_lenient_deserializer(request_class),
                response_serializer=response_class.SerializeToString,
            )
        else:
            handler = grpc.unary_unary_rpc_method_handler(
                _guard_unary(method, m.name),
                request_deserializer=_lenient_deserializer(request_class),
                response_serializer=response_class.SerializeToString,
            )
        handlers[m.name] = handler
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


class LiveRequest(Protocol):
    request_id: str  # the id the stream's responses are keyed by

    @property
    def finished(self) -> bool: ...


async def read_generate_stream(
    requests: AsyncIterator[Any],
    mux: StreamMux,
    live: Mapping[str, LiveRequest],
    submit: Callable[[str, spb.GenerateStreamRequest], Awaitable[None]],
    cancel: Callable[[Any], None],
    *,
    columns: bool,
    control: Callable[[spb.GenerateStreamRequest], None] | None = None,
) -> None:
    """Read a GenerateStream's requests until the client closes its side.

    Args:
        requests: the call's request iterator (``Undecodable`` where bytes did not parse).
        mux: the stream's responses; woken when reading ends (the writer then sees the reader done).
        live: the stream's requests by the client's id (``submit`` adds to it).
        submit: runs ``msg.generate`` under the client's id ``rid``; a refusal is its own to answer.
        cancel: stops a live request the client cancelled.
        columns: whether this stream answers in token columns when the client asks (the router does; a
            frontend answers with responses only, which such a client reads too).
        control: takes a frontend's ``resume``, ``take_over`` and owner-only messages, and a ``cancel_request_id`` of no
            request on this stream (the router's; None: resume and owner refused INVALID_ARGUMENT, such a
            cancel ignored, as a frontend answers its own clients).

    Raises:
        RouterError: INVALID_ARGUMENT for what cannot be answered by id (undecodable, no request_id, an
            id in use on the stream): the stream's status, since an answer could not be told from one
            to the request holding the id.
    """
    try:
        async for wire in requests:
            if isinstance(wire, Undecodable):
                raise RouterError(grpc.StatusCode.INVALID_ARGUMENT, f"undecodable {wire.message_type}: {wire.error}")
            batch = wire.batch.requests if wire.WhichOneof("kind") == "batch" else (wire,)
            for i, msg in enumerate(batch):
                if i and i % BATCH_TURN == 0:
                    await asyncio.sleep(0)  # NOTE: a large batch must not hold the loop (hostile sizes)
                await _read_one(msg, mux, live, submit, cancel, columns=columns, control=control)
    finally:
        mux.wake()


async def _read_one(
    msg: spb.GenerateStreamRequest,
    mux: StreamMux,
    live: Mapping[str, LiveRequest],
    submit: Callable[[str, spb.GenerateStreamRequest], Awaitable[None]],
    cancel: Callable[[Any], None],
    *,
    columns: bool,
    control: Callable[[spb.GenerateStreamRequest], None] | None,
) -> None:
    """One message of a GenerateStream (alone, or one of a batch's): as ``read_generate_stream`` says."""
    kind = msg.WhichOneof("kind")
    if kind == "batch":
        raise RouterError(grpc.StatusCode.INVALID_ARGUMENT, "a GenerateStream batch inside a batch")
    if kind in ("resume", "take_over") or (kind is None and msg.HasField("owner")):
        # NOTE: a frontend's own messages (docs/architecture.md 2a): an owner's Resume, a take-over for a
        # client resuming through it, or its stream saying whose it is (re-opened after a break: a restarted
        # router's notices must reach it)
        if control is None:
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT, "resume and owner are a frontend's messages")
        control(msg)
        return
    if msg.token_columns:
        if columns:
            mux.columns = True
        if kind is None:  # NOTE: a message that only says so
            return
    if msg.WhichOneof("kind") == "cancel_request_id":
        r = live.get(msg.cancel_request_id)
        if r is not None and not r.finished:
            cancel(r)
            mux.put(r.request_id, RouterError(grpc.StatusCode.CANCELLED, "cancelled by the client"))
        elif r is None and control is not None:
            control(msg)  # NOTE: none on this stream: a frontend's, maybe one a restarted router adopted
        return
    rid = msg.generate.request_id
    if not rid or rid in live:
        why = "missing" if not rid else f"{rid!r} already in use on this stream"
        raise RouterError(grpc.StatusCode.INVALID_ARGUMENT,
                          f"request_id {why}: GenerateStream requests need ids of their own")  # fmt: skip
    await submit(rid, msg)

