"""Text and chat prompts -> token ids off the event loop: the one bounded prompt preparer of the
router (``kvserve/router/gate/bounds.py``) and of a frontend (``kvserve/frontend/relay.py``).

Why off the loop, and in processes where it can: rendering a chat template is Python (regexes and
Jinja over the whole content, a second per megabyte) and even the tokenizer, which releases the GIL
while it encodes, takes it back to build the ids, so in a thread of the serving process either
stalls its loop on a loaded machine (issue 42).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.router.gate.limits import LimitExceeded
from kvserve.router.gate.prompts import (
    check_prompt_size,
    child_init,
    child_prompt_ids,
    longest_token_bytes,
    prompt_ids,
    with_token_ids,
)
from kvserve.router.gate.validation import ModelLimits
from kvserve.workers.text.chat_template import ChatTemplate

logger = logging.getLogger(__name__)


class PromptModel(Protocol):
    """What preparing a prompt reads of the model (read per request: the router learns ``limits``
    from its first worker's Hello). ``kvserve/router/requests/router.py`` ``Router`` is one; a
    frontend's is a ``FixedModel``."""

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer; None: only token-id prompts (``prepare`` refuses the others)."""

    @property
    def chat_template(self) -> ChatTemplate | None:
        """The model's chat template; None: chat prompts are refused."""

    @property
    def limits(self) -> ModelLimits | None:
        """Vocabulary and context bounds the ids must meet; None: not known yet (prompts pass as
        they are, and ``Router.submit`` answers UNAVAILABLE)."""


@dataclass(frozen=True)
class FixedModel:
    """A ``PromptModel`` that never changes (a frontend's: its tokenizer and template, and bounds
    it leaves to the router, which checks the ids against the workers' real vocabulary and length)."""

    tokenizer: Any
    chat_template: ChatTemplate | None
    limits: ModelLimits | None


class PromptPreparer:
    """Text and chat prompts -> token ids off the caller's event loop, at most ``max_pending`` waiting.

    ``prepare`` returns the request with its prompt replaced by the token ids (validated with the
    field names ``Router.submit`` uses), so ``submit`` does no tokenizing on the loop. With a
    ``model_dir`` and a tokenizer, prompts are tokenized (and rendered) in ``threads`` spawned
    processes that load that directory's tokenizer and template, so not under the caller's GIL;
    without one, or once a prompt process died, in ``threads`` threads.
    """

    def __init__(self, model: PromptModel, threads: int, max_pending: int, model_dir: str | None = None,
                 thread_name: str = "kvserve-prompt") -> None:  # fmt: skip
        self.model = model
        self.max_pending = max_pending
        self.pending = 0
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=thread_name)
        self._processes: ProcessPoolExecutor | None = None
        if model.tokenizer is not None:
            longest_token_bytes(model.tokenizer)  # NOTE: once, at start-up, not in a request's path
            if model_dir:
                # NOTE: spawn, not fork: the serving process runs gRPC and Ray threads.
                self._processes = ProcessPoolExecutor(threads, multiprocessing.get_context("spawn"),
                                                      initializer=child_init, initargs=(model_dir,))  # fmt: skip
                self._processes.submit(int)  # NOTE: start one now, not on the first chat request

    async def prepare(self, request: spb.GenerateRequest) -> spb.GenerateRequest:
        """``request`` with its text or chat prompt as token ids (any other prompt as it is).

        Raises:
            LimitExceeded: RESOURCE_EXHAUSTED, ``max_pending`` prompts already wait
                (``max_pending_prompts``).
            ValidationError: a bad prompt, naming its field (``Router.submit`` would say the same).
        """
        m = self.model
        limits, tokenizer = m.limits, m.tokenizer
        if request.WhichOneof("prompt") not in ("text", "messages") or limits is None:
            return request  # NOTE: ids are checked in submit (cheap); no limits yet: submit says why
        check_prompt_size(request, limits, tokenizer)  # NOTE: cheap, before the pool: a prompt that
        # cannot fit is refused without waiting for (or costing) a tokenizer pass
        if self.pending >= self.max_pending:
            raise LimitExceeded(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "max_pending_prompts",
                f"{self.pending} prompts are waiting to be tokenized; at most {self.max_pending}",
            )
        self.pending += 1
        try:
            loop = asyncio.get_running_loop()
            ids = None
            if self._processes is not None:
                try:
                    ids = await loop.run_in_executor(self._processes, child_prompt_ids, request.SerializeToString(),
                                                     limits)  # fmt: skip
                except BrokenProcessPool as e:  # NOTE: a prompt process died (OOM-killed...): threads from now on
                    logger.error("the prompt processes broke (%s); tokenizing in threads from now on", e)
                    self._processes = None
            if ids is None:
                ids = await loop.run_in_executor(self._pool, prompt_ids, request, limits, tokenizer, m.chat_template)
        finally:
            self.pending -= 1
        return with_token_ids(request, ids)

    def close(self) -> None:
        """Stop the threads and processes; prompts still waiting are cancelled."""
        pools: list[Executor] = [self._pool, *([self._processes] if self._processes is not None else [])]
        for pool in pools:
            pool.shutdown(wait=False, cancel_futures=True)
