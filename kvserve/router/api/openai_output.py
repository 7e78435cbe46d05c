"""OpenAI's response shapes from kvserve's ``GenerateResponse`` streams: the final object of a
non-streamed call (``Collected``) and the server-sent events of a streamed one (``Chunks``), with
usage (each prompt counted once however many choices) and log-probabilities (token text from the
tokenizer, ``token_id:N`` without one, as vLLM). Pure: no server, no event loop
(``kvserve/router/api/http_api.py`` feeds them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.router.api.openai_schema import api_error
from kvserve.router.requests.request import RouterError

DONE = "data: [DONE]\n\n"  # the SSE stream's last event, after the final chunk or an error


@dataclass
class Choice:
    """What one choice (one router request) accumulated."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    final: spb.GenerateResponse | None = None


def usage(choices: list[Choice], n: int) -> dict[str, Any]:
    finals = [c.final for c in choices if c.final is not None]
    # NOTE: OpenAI counts each prompt once, however many choices (n) it has.
    prompt = sum(c.final.usage.prompt_tokens for c in choices if c.final is not None and c.index % n == 0)
    completion = sum(f.usage.completion_tokens for f in finals)
    cached = sum(f.usage.cached_tokens for f in finals)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "x-cached-tokens": cached,
        "x-workers": [f.worker_id for f in finals],
        "x-preemptions": sum(f.num_preemptions for f in finals),
        "x-swaps": sum(f.num_swaps for f in finals),
        "x-migrations": sum(f.num_migrations for f in finals),
    }


class TokenText:
    """Token id -> its text, for logprobs (``token_id:N`` when the model has no tokenizer, as vLLM)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer

    def __call__(self, token_id: int) -> str:
        if self._tok is None:
            return f"token_id:{token_id}"
        return self._tok.decode([token_id], skip_special_tokens=False)


def chat_logprobs(resp: spb.GenerateResponse, k: int, text: TokenText) -> list[dict[str, Any]]:
    out = []
    for tid, lp in zip(resp.token_ids, resp.logprobs, strict=False):
        tok = text(tid)
        top = sorted(lp.logprobs.items(), key=lambda kv: -kv[1])[:k]
        out.append({
            "token": tok, "logprob": lp.logprob, "bytes": list(tok.encode()),
            "top_logprobs": [{"token": text(t), "logprob": v, "bytes": list(text(t).encode())} for t, v in top],
        })  # fmt: skip
    return out


def completion_logprobs(resp: spb.GenerateResponse, k: int, text: TokenText, offset: int) -> dict[str, Any]:
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for tid, lp in zip(resp.token_ids, resp.logprobs, strict=False):
        tok = text(tid)
        tokens.append(tok)
        token_logprobs.append(lp.logprob)
        tops.append({text(t): v for t, v in sorted(lp.logprobs.items(), key=lambda kv: -kv[1])[:k]})
        offsets.append(offset)
        offset += len(tok)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def merge_logprobs(acc: dict[str, Any] | None, new: dict[str, Any], chat: bool) -> dict[str, Any]:
    if acc is None:
        return new
    if chat:
        acc["content"].extend(new["content"])
    else:
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            acc[key].extend(new[key])
    return acc


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _logprobs(resp: spb.GenerateResponse, k: int, text: TokenText, chat: bool, offset: int) -> dict[str, Any]:
    return {"content": chat_logprobs(resp, k, text)} if chat else completion_logprobs(resp, k, text, offset)


class Collected:
    """A non-streamed answer: every choice's responses (``add``, in any interleaving of choices)
    accumulated into the final ``chat.completion`` / ``text_completion`` object (``result``)."""

    def __init__(self, num_choices: int, chat: bool, k: int, text: TokenText) -> None:
        """``k``: top log-probabilities listed per token (``top_logprobs``); ``text``: token text."""
        self.chat, self.k, self.text = chat, k, text
        self.choices = [Choice(i) for i in range(num_choices)]
        self.logprobs: list[dict[str, Any] | None] = [None] * num_choices

    def add(self, i: int, resp: spb.GenerateResponse) -> None:
        """Choice ``i``'s next response (in its order)."""
        c = self.choices[i]
        if self.k or resp.logprobs:
            new = _logprobs(resp, self.k, self.text, self.chat, len(c.text))
            self.logprobs[i] = merge_logprobs(self.logprobs[i], new, self.chat)
        c.text += resp.text_delta
        c.token_ids.extend(resp.token_ids)
        if resp.finish_reason:
            c.finish_reason, c.final = resp.finish_reason, resp

    def result(self, head: dict[str, Any], n: int, return_ids: bool) -> dict[str, Any]:
        """The OpenAI object: ``head`` (id, created, model), the choices, usage (``n`` choices a prompt)."""
        choices, logprobs = self.choices, self.logprobs
        if self.chat:
            out = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": logprobs[c.index], "finish_reason": c.finish_reason} for c in choices]  # fmt: skip
        else:
            out = [{"index": c.index, "text": c.text, "logprobs": logprobs[c.index], "finish_reason": c.finish_reason}
                   for c in choices]  # fmt: skip
        if return_ids:
            for o, c in zip(out, choices, strict=True):
                o["token_ids"] = c.token_ids
        obj = "chat.completion" if self.chat else "text_completion"
        return {**head, "object": obj, "choices": out, "usage": usage(choices, n)}


class Chunks:
    """A streamed answer as server-sent events: ``opening`` (chat: each choice's role), one
    ``chunk`` per response, ``usage_chunk`` last (with ``stream_options.include_usage``), then
    ``DONE``; ``error`` for a stream the router ended abnormally.

    ``text_offset``: the text characters its client already has (a resumed stream: the ``kvserve-resume``
    header's); a completion's logprobs ``text_offset`` goes on from there, as in the stream it resumes."""

    def __init__(self, head: dict[str, Any], num_choices: int, chat: bool, k: int, text: TokenText,
                 include_usage: bool, return_ids: bool, text_offset: int = 0) -> None:  # fmt: skip
        self.head, self.chat, self.k, self.text = head, chat, k, text
        self.text_offset = text_offset
        self.return_ids = return_ids
        self.obj = "chat.completion.chunk" if chat else "text_completion"
        self.choices = [Choice(i) for i in range(num_choices)]
        self.extra = {"usage": None} if include_usage else {}

    def _event(self, choice: dict[str, Any], token_ids: Any = ()) -> str:
        if self.return_ids:
            choice["token_ids"] = list(token_ids)
        return sse({**self.head, "object": self.obj, "choices": [choice], **self.extra})

    def opening(self) -> list[str]:
        """OpenAI's first chunk per chat choice: the role (none for completions)."""
        if not self.chat:
            return []
        return [self._event({"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}) for c in self.choices]  # fmt: skip

    def chunk(self, i: int, resp: spb.GenerateResponse) -> str:
        """Choice ``i``'s next response as one event."""
        c = self.choices[i]
        offset = self.text_offset + len(c.text)
        lp = _logprobs(resp, self.k, self.text, self.chat, offset) if self.k or resp.logprobs else None
        c.text += resp.text_delta
        finish = resp.finish_reason or None
        if finish:
            c.finish_reason, c.final = finish, resp
        if self.chat:
            delta = {"content": resp.text_delta} if resp.text_delta or not finish else {}
            return self._event({"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}, resp.token_ids)
        return self._event({"index": i, "text": resp.text_delta, "logprobs": lp, "finish_reason": finish},
                           resp.token_ids)  # fmt: skip

    def usage_chunk(self, n: int) -> str:
        """The final chunk: no choices, the usage of all of them (``n`` choices a prompt)."""
        return sse({**self.head, "object": self.obj, "choices": [], "usage": usage(self.choices, n)})

    def error(self, e: RouterError) -> str:
        """The router's refusal or failure as the stream's error event."""
        return sse(api_error(e, self.chat).body())
