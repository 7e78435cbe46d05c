"""What a frontend does before a request reaches the router, shared by its gRPC and HTTP APIs.

* prompts: text and chat prompts become token ids here, in a bounded thread pool
  (``kvserve/router/gate/prompt_preparer.py``, the very preparer the router uses; the template's markup
  alone yields control tokens), so the router only checks ids. NOTE: the model's vocabulary and context length
  are the workers' (the router knows them); the router checks the ids against them and its refusal
  is renamed back to the field the caller sent (``prompt.text`` / ``prompt.messages``);
* ids: a request without one gets ``req-<hex>``, as the router would name it;
* the relay itself (``kvserve/frontend/link.py``): one stream per caller credential, deadline and end
  client carried per request.
"""

from __future__ import annotations

import uuid
from typing import Any

import grpc

from kvserve.frontend.link import RelayedRequest, RouterLink
from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.router.gate.limits import InputLimits, LimitExceeded
from kvserve.router.gate.prompt_preparer import FixedModel, PromptPreparer
from kvserve.router.gate.validation import ModelLimits, ValidationError
from kvserve.router.requests.request import RouterError
from kvserve.workers.text.chat_template import ChatTemplate

# NOTE: no bound here: the router checks the ids against the workers' real vocabulary and length.
_UNBOUNDED = ModelLimits(vocab_size=1 << 62, max_model_len=1 << 62)
_PROMPT_FIELDS = {"text": "prompt.text", "messages": "prompt.messages"}


def frontend_prompts(tokenizer: Any, template: ChatTemplate | None, limits: InputLimits) -> PromptPreparer:
    """The frontend's prompt preparer (``kvserve/router/gate/prompt_preparer.py``, the router's own):
    ``prompt_threads`` threads, at most ``max_pending_prompts`` waiting, and no bound of the model's
    (the router's, with the workers' real vocabulary and length)."""
    return PromptPreparer(FixedModel(tokenizer, template, _UNBOUNDED), limits.prompt_threads,
                          limits.max_pending_prompts, thread_name="kvserve-frontend-prompt")  # fmt: skip


async def prepare(prompts: PromptPreparer, request: spb.GenerateRequest) -> spb.GenerateRequest:
    """``request`` with its prompt as token ids (ids prompts are passed as they are).

    Raises:
        RouterError: INVALID_ARGUMENT naming the field; RESOURCE_EXHAUSTED, too many prompts wait
            (with its ``retry-after-ms`` hint), as the router answers them.
    """
    try:
        return await prompts.prepare(request)
    except LimitExceeded as e:
        raise RouterError(e.code, str(e), e.trailers) from e
    except ValidationError as e:
        raise RouterError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from e


class Relay:
    """Prepare and relay requests to the router (``submit``), for both of a frontend's APIs."""

    def __init__(self, link: RouterLink, prompts: PromptPreparer, limits: InputLimits) -> None:
        self.link, self.prompts, self.limits = link, prompts, limits

    async def submit(
        self,
        client: str,
        requests: list[spb.GenerateRequest],
        authorization: str | None,
        timeout_s: float | None = None,
    ) -> list[RelayedRequest]:
        """Tokenize and relay every request; returns their handles (refusals arrive on them).

        Raises:
            RouterError: a prompt could not be prepared (nothing was relayed).
        """
        prepared = []
        for r in requests:
            p = await prepare(self.prompts, r)
            if not p.request_id:
                if p is r:
                    p = spb.GenerateRequest()
                    p.CopyFrom(r)
                p.request_id = f"req-{uuid.uuid4().hex[:12]}"
            prepared.append((p, _PROMPT_FIELDS.get(r.WhichOneof("prompt") or "")))
        out = []
        try:
            for p, field in prepared:
                rr = self.link.submit(authorization, p, timeout_s, client)
                rr.prompt_field = field
                out.append(rr)
        except RouterError:
            for rr in out:
                rr.cancel()
            raise
        return out

    async def admitted(self, handles: list[RelayedRequest]) -> None:
        """Wait until the router answered every request once; the first refusal is raised (the
        others are cancelled), so an HTTP caller gets its status before the stream starts.

        Raises:
            RouterError: the router refused one of them.
        """
        try:
            for rr in handles:
                first = await rr.first()
                if isinstance(first, RouterError):
                    raise first
        except BaseException:
            for rr in handles:
                rr.cancel()
            raise

    def close(self) -> None:
        self.prompts.close()
