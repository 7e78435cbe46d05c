"""The HTTP API's server-side deadline (``http_default_timeout_s``): the OpenAI API gives a client
no way to send a deadline, so every HTTP request gets the server's. Workers here are fakes that
take a request and never answer (a request that would otherwise run forever): once the deadline
passes the call ends with a clear timeout error and the request is aborted on its worker (which
frees its blocks there)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from kvserve.router.api.http_api import OpenAIApi
from kvserve.router.api.router_backend import RouterBackend
from tests.unit.test_router_failover import _commands, _router

TIMEOUT_S = 0.5
BOUND_S = 30.0  # the call must end long before this (it would never end without the deadline)


async def _call(router, body: dict) -> tuple[httpx.Response, float]:  # noqa: ANN001
    api = OpenAIApi(RouterBackend(router))
    transport = httpx.ASGITransport(app=api.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
        t0 = time.monotonic()
        resp = await asyncio.wait_for(client.post("/v1/completions", json=body), BOUND_S)
        return resp, time.monotonic() - t0


def _aborted(router, worker_rid: str) -> bool:  # noqa: ANN001
    return any(c.abort.request_id == worker_rid for w in router.table.entries for c in _commands(router, w))


def test_a_completion_without_a_client_deadline_ends_504_at_the_servers_and_is_aborted() -> None:
    async def test() -> None:
        router, workers = _router(http_default_timeout_s=TIMEOUT_S)
        resp, took = await _call(router, {"prompt": [1, 2, 3, 4], "max_tokens": 8})
        assert resp.status_code == 504, resp.text
        err = resp.json()["error"]
        assert err["type"] == "timeout" and "--http-default-timeout-s" in err["message"], err
        assert TIMEOUT_S <= took < BOUND_S
        ((added, *_), _) = next(w.added()[0] for w in workers.values() if w.added())
        assert _aborted(router, added.request_id), "the timed-out request was not aborted on its worker"
        assert not router.requests

    asyncio.run(test())


def test_a_streamed_completion_past_the_deadline_ends_with_a_timeout_event_and_is_aborted() -> None:
    async def test() -> None:
        router, workers = _router(http_default_timeout_s=TIMEOUT_S)
        resp, took = await _call(router, {"prompt": [1, 2, 3, 4], "max_tokens": 8, "stream": True})
        assert resp.status_code == 200
        events = [line.removeprefix("data: ") for line in resp.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events
        err = json.loads(events[-2])["error"]
        assert err["type"] == "timeout" and "--http-default-timeout-s" in err["message"], err
        assert TIMEOUT_S <= took < BOUND_S
        ((added, *_), _) = next(w.added()[0] for w in workers.values() if w.added())
        assert _aborted(router, added.request_id)
        assert not router.requests

    asyncio.run(test())
