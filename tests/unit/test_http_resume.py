"""The HTTP API's resume extension (kvserve/router/api/http_api.py ``kvserve-resume``; docs/architecture.md 2a
"Resuming through another frontend") where it must refuse: the router's own HTTP API (no frontend: 400 naming
the header), a malformed header, a resume that is not one streamed choice. Its working path is tested end to end
through real frontends (tests/chaos/test_frontend_resume.py)."""

from __future__ import annotations

import asyncio

import httpx

from kvserve.router.api.http_api import RESUME_HEADER, OpenAIApi
from kvserve.router.api.router_backend import RouterBackend
from tests.unit.test_router_failover import _router

BODY = {"prompt": [5, 6, 7], "max_tokens": 4, "stream": True}


class _Fronted(RouterBackend):
    """A backend that could take over (a frontend's): the header is parsed before it is called."""

    async def take_over(self, *args: object) -> None:
        raise AssertionError("a malformed resume reached the take-over")


async def _post(body: dict, header: str, backend: type = RouterBackend) -> httpx.Response:
    router, _ = _router()
    api = OpenAIApi(backend(router))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api.app), base_url="http://router") as client:
        return await asyncio.wait_for(client.post("/v1/completions", json=body, headers={RESUME_HEADER: header}), 30)


def test_the_router_direct_and_malformed_resumes_are_refused_400_naming_the_header() -> None:
    async def test() -> None:
        for body, header, why in (
            (BODY, "req-1 " + "ab" * 16 + " 3 3", "a stream resumes only through a frontend"),
            ({**BODY, "stream": False}, "req-1 t 3 3", "stream true, n 1"),
            ({**BODY, "n": 2}, "req-1 t 3 3", "stream true, n 1"),
        ):
            resp = await _post(body, header)
            err = resp.json()["error"]
            assert resp.status_code == 400 and err["param"] == RESUME_HEADER and why in err["message"], resp.text
        for header in ("req-1 t 3", "req-1 t x 3", "req-1 t 3 -1"):
            resp = await _post(BODY, header, _Fronted)
            assert resp.status_code == 400 and resp.json()["error"]["param"] == RESUME_HEADER, (header, resp.text)

    asyncio.run(test())
