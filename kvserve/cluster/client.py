"""Python clients for the router's gRPC API (``kvserve.v1.KVServe``): sync and asyncio.

``KVServeClient`` (``grpc``) and ``AsyncKVServeClient`` (``grpc.aio``) have the same methods:

* ``generate(prompt, ...)`` or ``generate(messages=[("user", "Hi")], ...)`` (a chat, rendered
  with the model's chat template by the router): a stream of ``GenerateResponse`` (token ids + text deltas; the last
  message carries ``finish_reason``, usage and the preemption/swap/migration counts). The stream
  has ``cancel()``; leaving its ``with`` block cancels it too, which frees the request's KV blocks
  on the cluster at once.
* ``generate_all(prompt, ...)`` -> ``(token_ids, text, final_response)``.
* ``abort(request_id)`` -> whether the router knew the request; its stream then ends CANCELLED.
* ``status()`` -> ``ClusterStatus``; ``watch(interval_ms)`` -> a stream of them.

Retries (``GenerateRetry``), only while no response of that stream has arrived (so a retry can
never duplicate tokens), at most ``max_attempts`` attempts in all, and only while the wait fits
``max_retry_wait_s`` and the call's deadline:

* RESOURCE_EXHAUSTED (router queue full): after the time the router's ``retry-after-ms`` trailer
  asks for (exponential backoff when it sends none).
* UNAVAILABLE (the router died or restarts, no worker can serve yet, the connection broke): after
  an exponential backoff, and the retry waits for the channel to connect again
  (``wait_for_ready``) within the deadline, so a router restart costs one attempt, not all of them.

Resume (docs/architecture.md section 2a, "Resuming through another frontend"): a stream served by a
frontend carries a ``resume_token`` on its first response. If the call then ends UNAVAILABLE (its
frontend died), the stream sends ``GenerateRequest.resume`` (its request id, the token, the tokens and
text characters it already yielded: ``ResumeCursor``) to the client's addresses in turn, from the one after
the address that failed (one address: that one again, which behind a shared port reaches a live frontend),
for up to ``RESUME_WINDOW_S`` (the router keeps a lost owner's requests ``OWNER_GRACE_S``), and goes on
yielding exactly the tokens after those it already yielded. A refused resume (NOT_FOUND: the request
ended, or the token does not match) is raised. Without a token (the router direct) every error after the
first response is raised as the call ended, UNAVAILABLE included; a
caller that wants to go on resubmits (greedy and seeded requests produce the same tokens again).
Every other error is raised at once.

Deadlines: every call has one. ``timeout=None`` (the default, per client or per call) means
``DEFAULT_GENERATE_TIMEOUT_S`` for a Generate (covering its retries) and ``DEFAULT_CALL_TIMEOUT_S``
for the unary calls; ``watch`` alone runs until cancelled unless given one.

``generate_remote`` runs ``kvserve generate --server HOST:PORT``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

import grpc

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.protos.kvserve.v1 import serving_pb2_grpc
from kvserve.workers.core.tls import channel_credentials

logger = logging.getLogger(__name__)

RETRY_AFTER_KEY = "retry-after-ms"
AUTH_TOKEN_ENV = "KVSERVE_AUTH_TOKEN"
DEFAULT_MAX_ATTEMPTS = 5
DEFAULT_MAX_RETRY_WAIT_S = 30.0  # the router's retry-after ceiling
DEFAULT_BACKOFF_S = 0.1  # first wait when the router sends no retry-after-ms, doubled per attempt
MAX_UNAVAILABLE_BACKOFF_S = 2.0  # the longest wait before retrying an UNAVAILABLE Generate
# NOTE: the router keeps a dead frontend's requests OWNER_GRACE_S (10 s: kvserve/router/requests/owned.py) for a
# resume; trying longer finds nothing to resume.
RESUME_WINDOW_S = 10.0
MAX_RESUME_BACKOFF_S = 1.0
# NOTE: no call waits forever for a router that will never answer. A Generate's default covers a
# long generation (thousands of tokens on a loaded GPU); the unary calls answer from router tables.
DEFAULT_GENERATE_TIMEOUT_S = 600.0
DEFAULT_CALL_TIMEOUT_S = 30.0
RETRIED_CODES = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)
MAX_MESSAGE_BYTES = 16 << 20
REMOTE_MAX_CONCURRENCY = 256

Prompt = str | Sequence[int]
# A chat: (role, content) pairs or {"role": ..., "content": ...} mappings, in order.
Messages = Sequence[tuple[str, str]] | Sequence[Mapping[str, str]]


# ---- shared helpers -----------------------------------------------------------------------------
def _channel_options(tls_server_name: str | None) -> list[tuple[str, Any]]:
    options: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ]
    if tls_server_name:
        options.append(("grpc.ssl_target_name_override", tls_server_name))
    return options


def open_channel(
    channel_module: Any,
    address: str,
    tls_ca: str | None,
    tls_cert: str | None,
    tls_key: str | None,
    tls_server_name: str | None,
) -> Any:
    """A plaintext or TLS channel to the router from ``grpc`` or ``grpc.aio`` (same call shapes)."""
    creds = channel_credentials(tls_ca, tls_cert, tls_key)
    options = _channel_options(tls_server_name)
    if creds is None:
        return channel_module.insecure_channel(address, options=options)
    return channel_module.secure_channel(address, creds, options=options)


def chat_messages(messages: Messages) -> spb.ChatMessages:
    """(role, content) pairs or role/content mappings -> the proto (the router validates them)."""
    out = spb.ChatMessages()
    for m in messages:
        role, content = (m["role"], m["content"]) if isinstance(m, Mapping) else m
        out.messages.add(role=role, content=content)
    return out


def build_request(
    prompt: Prompt | None = None,
    *,
    messages: Messages | None = None,
    max_tokens: int = 0,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    logprobs: int | None = None,
    request_id: str | None = None,
    priority: int = 0,
    tenant: str = "",
) -> spb.GenerateRequest:
    """A ``GenerateRequest``: a ``str`` prompt is sent as text (the router tokenizes it), a
    sequence of ints as token ids; or, instead of a prompt, ``messages`` (a chat the router renders
    with the model's chat template, assistant turn opened). ``max_tokens=0`` = the server's default; ``temperature=0`` =
    greedy; ``top_p=None`` = off; ``logprobs=k`` = each response carries, per token, the sampled
    token's logprob and the top k. The router validates every value (INVALID_ARGUMENT)."""
    if (prompt is None) == (messages is None):
        raise TypeError("give a prompt or messages (not both)")
    if messages is not None:
        request = spb.GenerateRequest(messages=chat_messages(messages))
    elif isinstance(prompt, str):
        request = spb.GenerateRequest(text=prompt)
    elif isinstance(prompt, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        request = spb.GenerateRequest(token_ids=spb.TokenIds(ids=list(prompt)))
    else:
        raise TypeError(f"prompt must be a str or a sequence of token ids, got {type(prompt).__name__}")
    s = request.sampling
    s.max_tokens, s.temperature, s.top_k, s.ignore_eos = max_tokens, temperature, top_k, ignore_eos
    if top_p is not None:
        s.top_p = top_p
    if seed is not None:
        s.seed = seed
    if logprobs is not None:
        s.logprobs = logprobs
    s.stop.extend(stop)
    s.stop_token_ids.extend(stop_token_ids)
    request.request_id = request_id or ""
    request.priority = priority
    request.tenant = tenant
    return request


def sampling_kwargs(params: Any) -> dict[str, Any]:
    """``generate`` keyword arguments from a ``workers.core.sampling_params.SamplingParams``."""
    return {
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_k": params.top_k,
        "top_p": None if params.top_p == 1.0 else params.top_p,
        "seed": params.seed,
        "stop": tuple(params.stop),
        "stop_token_ids": tuple(params.stop_token_ids),
        "ignore_eos": params.ignore_eos,
        "logprobs": params.logprobs,
    }


def retry_after_s(error: grpc.RpcError) -> float | None:
    """The router's ``retry-after-ms`` trailer of a failed call, in seconds (None if absent)."""
    try:
        trailers = error.trailing_metadata() or ()
    except Exception:  # noqa: BLE001 - an error raised before the call started has none
        return None
    for key, value in trailers:
        if key == RETRY_AFTER_KEY:
            try:
                return max(0.0, int(value) / 1000)
            except (TypeError, ValueError):
                return None
    return None


class GenerateRetry:
    """Retry bookkeeping of one Generate: attempts, backoff, deadline (the policy of the module doc).

    Args:
        max_attempts: attempts in all (the first included).
        max_wait_s: never wait longer than this before one retry.
        timeout: the whole Generate's deadline in seconds, retries included (None: none).
    """

    def __init__(self, max_attempts: int, max_wait_s: float, timeout: float | None) -> None:
        self.max_attempts = max(1, max_attempts)
        self.max_wait_s = max_wait_s
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.attempts = 0
        # The next attempt should wait for the channel to connect (the last one found no router).
        self.wait_for_ready = False

    def remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def wait_for(self, error: grpc.RpcError, received: bool, cancelled: bool) -> float | None:
        """Seconds to wait before retrying after ``error``; None = give up (raise it)."""
        code = error.code()
        if received or cancelled or code not in RETRIED_CODES:
            return None
        if self.attempts >= self.max_attempts:
            return None
        backoff = DEFAULT_BACKOFF_S * 2 ** (self.attempts - 1)
        if code == grpc.StatusCode.UNAVAILABLE:
            wait = min(backoff, MAX_UNAVAILABLE_BACKOFF_S)
        else:
            hint = retry_after_s(error)
            wait = hint if hint is not None else backoff
        # NOTE: up to 10% later than asked, so clients refused together do not return together.
        wait *= 1.0 + 0.1 * random.random()
        remaining = self.remaining()
        if wait > self.max_wait_s or (remaining is not None and wait >= remaining):
            return None
        self.wait_for_ready = code == grpc.StatusCode.UNAVAILABLE
        logger.info("router answered %s; retrying in %.2fs (attempt %d of %d)", code.name, wait,
                    self.attempts + 1, self.max_attempts)  # fmt: skip
        return wait


def _accumulate(responses: list[spb.GenerateResponse]) -> tuple[list[int], str, spb.GenerateResponse]:
    if not responses:
        raise RuntimeError("Generate stream ended without a response")
    ids = [t for r in responses for t in r.token_ids]
    return ids, "".join(r.text_delta for r in responses), responses[-1]


class ResumeCursor:
    """What a stream yielded so far, for a resume through another frontend: the request's id, its resume token
    (from the first response that carried one), the tokens and the text characters yielded."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.token = ""
        self.num_tokens = 0
        self.num_text_chars = 0

    def observe(self, response: spb.GenerateResponse) -> None:
        """``response`` is being yielded to the caller."""
        self.request_id = response.request_id or self.request_id
        if response.resume_token:
            self.token = response.resume_token
        self.num_tokens += len(response.token_ids)
        self.num_text_chars += len(response.text_delta)

    def request(self) -> spb.GenerateRequest:
        """The ``GenerateRequest`` that resumes the stream after what was yielded."""
        return spb.GenerateRequest(request_id=self.request_id, resume=spb.ResumeStream(
            token=self.token, num_tokens=self.num_tokens, num_text_chars=self.num_text_chars))  # fmt: skip


class _GenerateAttempts:
    """What the sync and async Generate streams share: the request, its ``GenerateRetry``, the live call
    (a fresh attempt after each retried error), the router's request id, and ``cancel``. The streams
    differ only in how they read the call and wait."""

    def __init__(self, client: _ClientBase, request: spb.GenerateRequest, timeout: float | None) -> None:
        self._client = client
        self._request = request
        self._retry = GenerateRetry(client.max_attempts, client.max_retry_wait_s, timeout)
        self._call: Any = None
        self._received = False
        self._cancelled = False
        self.request_id = request.request_id  # the router's id once the first response arrived
        self.cursor = ResumeCursor(request.request_id)
        self._address = 0  # index into the client's addresses of the next call
        self._resume_until: float | None = None  # resuming: give up at this monotonic time
        self._resume_tries = 0
        self.resumes = 0  # resumed calls that yielded a response (tests, logs)

    def _live_call(self) -> Any:
        """The call to read: the live one, else a new attempt's (a resume once a response was yielded); None once
        cancelled (the stream ends)."""
        if self._call is None:
            if self._cancelled:
                return None
            stub = self._client._stub_at(self._address)
            if self._received:
                # NOTE: no wait_for_ready: a dead frontend's address must fail at once so the next one is tried
                self._call = stub.Generate(self.cursor.request(), timeout=self._retry.remaining(),
                                           metadata=self._client._metadata)  # fmt: skip
            else:
                self._retry.attempts += 1
                self._call = stub.Generate(
                    self._request,
                    timeout=self._retry.remaining(),
                    metadata=self._client._metadata,
                    wait_for_ready=self._retry.wait_for_ready,
                )
        return self._call

    def _retry_wait(self, error: grpc.RpcError) -> float | None:
        """Seconds to wait before the next attempt (the failed call is dropped); None: raise ``error``."""
        if self._received:
            wait = self._resume_wait(error)
        else:
            wait = self._retry.wait_for(error, False, self._cancelled)
            if wait is not None and error.code() == grpc.StatusCode.UNAVAILABLE:
                self._address += 1  # NOTE: that address may be a dead frontend: the next one first
        if wait is not None:
            self._call = None
        return wait

    def _resume_wait(self, error: grpc.RpcError) -> float | None:
        """After a response: seconds before resuming through the next address; None: raise ``error`` (not
        UNAVAILABLE, no resume token, cancelled, past ``RESUME_WINDOW_S`` or the deadline)."""
        if self._cancelled or error.code() != grpc.StatusCode.UNAVAILABLE or not self.cursor.token:
            return None
        now = time.monotonic()
        if self._resume_until is None:
            self._resume_until, self._resume_tries = now + RESUME_WINDOW_S, 0
        if now >= self._resume_until:
            return None
        self._resume_tries += 1
        self._address += 1
        # NOTE: every address once at once, then backoff: a frontend restarting or a take-over under way
        rounds = (self._resume_tries - 1) // len(self._client.addresses)
        wait = 0.0 if rounds == 0 else min(DEFAULT_BACKOFF_S * 2 ** (rounds - 1), MAX_RESUME_BACKOFF_S)
        remaining = self._retry.remaining()
        if remaining is not None and wait >= remaining:
            return None
        logger.info("stream %s: %s; resuming after %d tokens through %s", self.cursor.request_id, error.code().name,
                    self.cursor.num_tokens, self._client.addresses[self._address % len(self._client.addresses)])
        return wait

    def _received_one(self, response: spb.GenerateResponse) -> spb.GenerateResponse:
        # NOTE: from here on an error is retried only as a resume (the cursor says what the caller has).
        if self._resume_until is not None:
            self._resume_until = None
            self.resumes += 1
        self._received = True
        self.request_id = response.request_id or self.request_id
        self.cursor.observe(response)
        return response

    def cancel(self) -> None:
        """Cancel the call (the router frees the request's blocks); further reads raise CANCELLED."""
        self._cancelled = True
        if self._call is not None:
            self._call.cancel()


# ---- sync -----------------------------------------------------------------------------------------
class GenerateStream(_GenerateAttempts, Iterator[spb.GenerateResponse]):
    """The responses of one Generate (``KVServeClient.generate``); retries as the module says."""

    def __iter__(self) -> GenerateStream:
        return self

    def __next__(self) -> spb.GenerateResponse:
        while True:
            call = self._live_call()
            if call is None:
                raise StopIteration
            try:
                response = next(call)
            except grpc.RpcError as e:
                wait = self._retry_wait(e)
                if wait is None:
                    raise
                time.sleep(wait)
                continue
            return self._received_one(response)

    def __enter__(self) -> GenerateStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


class _ClientBase:
    """What both clients share: the channel (plain or TLS), auth metadata, deadlines, retry policy."""

    _channels: Any = grpc  # grpc or grpc.aio

    def __init__(
        self,
        address: str | Sequence[str],
        auth_token: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        timeout: float | None = None,
        *,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        max_retry_wait_s: float = DEFAULT_MAX_RETRY_WAIT_S,
        tls_server_name: str | None = None,
    ) -> None:
        self.addresses = [address] if isinstance(address, str) else list(address)
        if not self.addresses:
            raise ValueError("give at least one address")
        self.address = self.addresses[0]
        self.timeout = timeout
        self.max_attempts = max_attempts
        self.max_retry_wait_s = max_retry_wait_s
        self._metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else ()
        self._tls = (tls_ca, tls_cert, tls_key, tls_server_name)
        self._channel = open_channel(self._channels, self.address, tls_ca, tls_cert, tls_key, tls_server_name)
        self._stub = serving_pb2_grpc.KVServeStub(self._channel)
        self._more: dict[int, tuple[Any, Any]] = {}  # address index -> (channel, stub), opened on first use

    def _stub_at(self, index: int) -> Any:
        """The stub of ``addresses[index % len]`` (the first address's is the client's own ``_stub``)."""
        i = index % len(self.addresses)
        if i == 0:
            return self._stub
        if i not in self._more:
            channel = open_channel(self._channels, self.addresses[i], *self._tls)
            self._more[i] = (channel, serving_pb2_grpc.KVServeStub(channel))
        return self._more[i][1]

    def _timeout(self, timeout: float | None, default: float = DEFAULT_CALL_TIMEOUT_S) -> float:
        """The deadline of a call: its own, else the client's, else ``default`` (never none)."""
        if timeout is not None:
            return timeout
        return self.timeout if self.timeout is not None else default


class KVServeClient(_ClientBase):
    """A blocking client of one router.

    Args:
        address: the router's ``host:port``, or several frontends' (a stream resumes through the next one when
            its frontend dies; a fresh request that finds one UNAVAILABLE is retried on the next).
        auth_token: sent as ``authorization: Bearer <token>`` on every call.
        tls_ca: PEM CA of the router's certificate; giving it (or a client cert) switches to TLS.
        tls_cert, tls_key: this client's PEM certificate and key (mTLS).
        timeout: default deadline in seconds of every call (per call override: ``timeout=``);
            a Generate's deadline covers its retries. None: ``DEFAULT_GENERATE_TIMEOUT_S`` for a
            Generate, ``DEFAULT_CALL_TIMEOUT_S`` for the others (``watch``: none).
        max_attempts: Generate attempts in all when the router answers RESOURCE_EXHAUSTED or
            UNAVAILABLE before the first response.
        max_retry_wait_s: give up rather than wait longer than this for one retry.
        tls_server_name: expect this name in the router's certificate instead of the host's.
    """

    def generate(self, prompt: Prompt | None = None, *, timeout: float | None = None, **kwargs: Any) -> GenerateStream:
        """Stream one request's responses. Keyword arguments: those of ``build_request``."""
        return GenerateStream(self, build_request(prompt, **kwargs), self._timeout(timeout, DEFAULT_GENERATE_TIMEOUT_S))

    def generate_all(
        self, prompt: Prompt | None = None, *, timeout: float | None = None, **kwargs: Any
    ) -> tuple[list[int], str, spb.GenerateResponse]:
        """Run one request to its end: (all token ids, all text, the final response)."""
        with self.generate(prompt, timeout=timeout, **kwargs) as stream:
            return _accumulate(list(stream))

    def abort(self, request_id: str, *, timeout: float | None = None) -> bool:
        """Abort a request by id; False if the router does not know it (unknown or finished)."""
        response = self._stub.Abort(
            spb.AbortRequest(request_id=request_id), timeout=self._timeout(timeout), metadata=self._metadata
        )
        return response.found

    def status(self, *, timeout: float | None = None) -> spb.ClusterStatus:
        return self._stub.GetClusterStatus(
            spb.ClusterStatusRequest(), timeout=self._timeout(timeout), metadata=self._metadata
        )

    def watch(self, interval_ms: int = 0, *, timeout: float | None = None) -> Any:
        """A ``ClusterStatus`` every ``interval_ms`` (0 = server default) until ``.cancel()``.

        NOTE: no default deadline here: a watch is meant to run until cancelled.
        """
        return self._stub.WatchBlockPressure(
            spb.WatchRequest(interval_ms=interval_ms), timeout=timeout, metadata=self._metadata
        )

    def close(self) -> None:
        self._channel.close()
        for channel, _ in self._more.values():
            channel.close()

    def __enter__(self) -> KVServeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- asyncio -------------------------------------------------------------------------------------
class AsyncGenerateStream(_GenerateAttempts, AsyncIterator[spb.GenerateResponse]):
    """The responses of one Generate (``AsyncKVServeClient.generate``); retries as the sync stream."""

    def __aiter__(self) -> AsyncGenerateStream:
        return self

    async def __anext__(self) -> spb.GenerateResponse:
        while True:
            call = self._live_call()
            if call is None:
                raise StopAsyncIteration
            try:
                response = await call.read()
            except asyncio.CancelledError:
                # grpc.aio reads of a call cancelled by ``cancel()`` raise CancelledError; unless this
                # task is being cancelled itself, answer as the sync stream does: RpcError(CANCELLED).
                task = asyncio.current_task()
                if not self._cancelled or (task is not None and getattr(task, "cancelling", lambda: 0)()):
                    raise
                raise grpc.aio.AioRpcError(
                    grpc.StatusCode.CANCELLED, grpc.aio.Metadata(), grpc.aio.Metadata(), "cancelled by the client"
                ) from None
            except grpc.RpcError as e:
                wait = self._retry_wait(e)
                if wait is None:
                    raise
                await asyncio.sleep(wait)
                continue
            if response is grpc.aio.EOF:
                raise StopAsyncIteration
            return self._received_one(response)

    async def __aenter__(self) -> AsyncGenerateStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()


class AsyncKVServeClient(_ClientBase):
    """``KVServeClient``'s API on ``grpc.aio``; create and use it inside one running event loop."""

    _channels = grpc.aio

    def generate(
        self, prompt: Prompt | None = None, *, timeout: float | None = None, **kwargs: Any
    ) -> AsyncGenerateStream:
        """Stream one request's responses (``async for``). Keyword arguments: ``build_request``'s."""
        return AsyncGenerateStream(
            self, build_request(prompt, **kwargs), self._timeout(timeout, DEFAULT_GENERATE_TIMEOUT_S)
        )

    async def generate_all(
        self, prompt: Prompt | None = None, *, timeout: float | None = None, **kwargs: Any
    ) -> tuple[list[int], str, spb.GenerateResponse]:
        async with self.generate(prompt, timeout=timeout, **kwargs) as stream:
            return _accumulate([r async for r in stream])

    async def abort(self, request_id: str, *, timeout: float | None = None) -> bool:
        response = await self._stub.Abort(
            spb.AbortRequest(request_id=request_id), timeout=self._timeout(timeout), metadata=self._metadata
        )
        return response.found

    async def status(self, *, timeout: float | None = None) -> spb.ClusterStatus:
        return await self._stub.GetClusterStatus(
            spb.ClusterStatusRequest(), timeout=self._timeout(timeout), metadata=self._metadata
        )

    def watch(self, interval_ms: int = 0, *, timeout: float | None = None) -> Any:
        """An async stream of ``ClusterStatus`` (``async for``) until ``.cancel()``."""
        return self._stub.WatchBlockPressure(
            spb.WatchRequest(interval_ms=interval_ms), timeout=timeout, metadata=self._metadata
        )

    async def close(self) -> None:
        await self._channel.close()
        for channel, _ in self._more.values():
            await channel.close()

    async def __aenter__(self) -> AsyncKVServeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


# ---- `kvserve generate --server` ------------------------------------------------------------------
def generate_remote(
    args: argparse.Namespace, prompts: Sequence[Prompt], params: Any
) -> list[tuple[list[int], str, str]]:
    """Send every prompt to the router at ``args.server`` at once; results in input order as
    ``(token_ids, text, finish_reason)``.

    Reads ``args.auth_token`` (default: $KVSERVE_AUTH_TOKEN), ``args.tls_ca``, ``args.tls_cert``,
    ``args.tls_key`` and ``args.timeout`` when present.

    Raises:
        SystemExit: naming the status of the first request that failed.
    """
    kwargs = sampling_kwargs(params)
    token = getattr(args, "auth_token", None) or os.environ.get(AUTH_TOKEN_ENV) or None

    async def run() -> list[tuple[list[int], str, str]]:
        async with AsyncKVServeClient(
            args.server,
            auth_token=token,
            tls_ca=getattr(args, "tls_ca", None),
            tls_cert=getattr(args, "tls_cert", None),
            tls_key=getattr(args, "tls_key", None),
            timeout=getattr(args, "timeout", None),
        ) as client:
            limit = asyncio.Semaphore(REMOTE_MAX_CONCURRENCY)

            async def one(prompt: Prompt) -> tuple[list[int], str, str]:
                async with limit:
                    if isinstance(prompt, list) and prompt and isinstance(prompt[0], tuple):  # a chat
                        ids, text, final = await client.generate_all(messages=prompt, **kwargs)
                    else:
                        ids, text, final = await client.generate_all(prompt, **kwargs)
                return ids, text, final.finish_reason

            tasks = [asyncio.ensure_future(one(p)) for p in prompts]
            try:
                return list(await asyncio.gather(*tasks))
            finally:
                for t in tasks:  # one failed: stop the rest before the channel closes
                    t.cancel()

    try:
        return asyncio.run(run())
    except grpc.RpcError as e:
        raise SystemExit(f"error: {args.server}: {e.code().name}: {e.details()}") from e
