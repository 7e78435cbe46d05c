"""A request's prompt as token ids: given as ids, as text (tokenized), or as chat messages (rendered
with the model's chat template, then tokenized). Pure: no router state, no I/O."""

from __future__ import annotations

import functools
from typing import Any

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.router.gate.validation import (
    MAX_TEXT_CHARS,
    ModelLimits,
    ValidationError,
    chat_messages,
    validate_prompt_ids,
)
from kvserve.workers.text.chat_encoding import encode_chat
from kvserve.workers.text.chat_template import ChatTemplate

# NOTE: a token covers at most its own decoded bytes plus one (a SentencePiece word-start marker
# decodes to nothing at the start of a text); 2x the longest token bounds that for any token of >= 1 byte.
_COVER_MARGIN = 2


@functools.lru_cache(maxsize=8)
def longest_token_bytes(tokenizer: Any) -> int | None:
    """UTF-8 bytes of the vocabulary's longest token (special and added tokens included); computed
    once per tokenizer (a decode per id: tenths of a second for a 50k vocabulary, at start-up).
    None for a tokenizer that cannot list its vocabulary (then no size bound applies)."""
    if not isinstance(getattr(tokenizer, "vocab_size", None), int) or not hasattr(tokenizer, "decode"):
        return None
    return max(
        (len(tokenizer.decode([i], skip_special_tokens=False).encode("utf-8", "replace"))
         for i in range(tokenizer.vocab_size)),
        default=1,
    ) or 1  # fmt: skip


def check_prompt_size(request: spb.GenerateRequest, limits: ModelLimits, tokenizer: Any) -> None:
    """Refuses a text or chat prompt that cannot fit ``max_model_len`` tokens, by its size alone.

    Contract: cheap (a length and a UTF-8 encode, no tokenizing, no template) and sound: it refuses
    only text of more than ``2 x max_model_len x longest_token_bytes`` bytes, which no tokenization
    can fit in ``max_model_len`` tokens (each token covers at most ``2 x`` its longest's bytes).
    Chat content counts alone (the template only adds to it). Run before any tokenizing, so a
    megabyte prompt costs the router microseconds, not a tokenizer pass (issue 42).

    Raises:
        ValidationError: ``prompt.text`` / ``prompt.messages``, naming the bound.
    """
    kind = request.WhichOneof("prompt")
    longest = longest_token_bytes(tokenizer) if tokenizer is not None and kind in ("text", "messages") else None
    if longest is None:
        return
    bound = _COVER_MARGIN * limits.max_model_len * longest
    if kind == "text":
        chars, field = len(request.text), "prompt.text"
        size = chars if chars > bound else len(request.text.encode("utf-8", "surrogatepass"))
    else:
        chars, field = sum(len(m.content) for m in request.messages.messages), "prompt.messages"
        size = chars if chars > bound else sum(len(m.content.encode("utf-8", "surrogatepass"))
                                               for m in request.messages.messages)  # fmt: skip
    if size > bound:
        raise ValidationError(
            field,
            f"{size} {'characters' if chars > bound else 'bytes'} cannot fit max_model_len={limits.max_model_len} "
            f"tokens (at most {bound} bytes can)",
        )


def prompt_ids(
    request: spb.GenerateRequest, limits: ModelLimits, tokenizer: Any, chat_template: ChatTemplate | None
) -> list[int]:
    """The prompt's token ids.

    Args:
        request: the client's request (one of ``token_ids``, ``text``, ``messages`` set).
        limits: the model's vocabulary and context limits.
        tokenizer: the model's tokenizer, or None (then only ``token_ids`` are accepted).
        chat_template: the model's chat template, or None (then ``messages`` are refused).

    Raises:
        ValidationError: naming the field (``prompt.text``, ``prompt.messages[i].role``, ...).
    """
    kind = request.WhichOneof("prompt")
    check_prompt_size(request, limits, tokenizer)
    if kind == "token_ids":
        ids = list(request.token_ids.ids)
        validate_prompt_ids(ids, limits)
        return ids
    if kind == "text":
        if tokenizer is None:
            raise ValidationError("prompt.text", "this model has no tokenizer; send prompt.token_ids")
        if not request.text:
            raise ValidationError("prompt.text", "empty prompt")
        if len(request.text) > MAX_TEXT_CHARS:  # NOTE: before tokenizing it on the event loop
            raise ValidationError("prompt.text", f"longer than {MAX_TEXT_CHARS} characters")
        ids = tokenizer.encode(request.text)
        validate_prompt_ids(ids, limits, "prompt.text")
        return ids
    if kind == "messages":
        messages = chat_messages(request.messages)
        if tokenizer is None or chat_template is None:
            raise ValidationError("prompt.messages", "this model has no chat template; send prompt.text")
        try:
            # NOTE: only the template's own markup yields control tokens (BOS included); special-token
            # strings inside content stay text (kvserve/workers/text/chat_encoding.py, README "Security").
            ids = encode_chat(tokenizer, chat_template, messages, add_generation_prompt=True)
        except ValueError as e:  # ChatTemplateError, or content that cannot stay text
            raise ValidationError("prompt.messages", str(e)) from e
        validate_prompt_ids(ids, limits, "prompt.messages")
        return ids
    if request.HasField("resume"):  # NOTE: a frontend's client resuming; the router direct owns no stream to resume
        raise ValidationError("resume", "a stream resumes only through a frontend (kvserve frontend / --frontends)")
    raise ValidationError("prompt", "set prompt.text, prompt.token_ids or prompt.messages")


_CHILD: tuple[ModelLimits | None, Any, ChatTemplate | None] = (None, None, None)


def child_init(model_dir: str) -> None:
    """A prompt process's start (``kvserve/router/gate/prompt_preparer.py``): its own tokenizer and chat template,
    and a watchdog that ends it when the router's process is gone (a SIGKILLed router, whose pool
    never shuts down, must not leave its prompt processes behind)."""
    import os
    import threading
    import time

    from kvserve.workers.text.tokenizer import load_tokenizer

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="kvserve-prompt-parent-watch", daemon=True).start()
    global _CHILD
    _CHILD = (None, load_tokenizer(model_dir), ChatTemplate.from_dir(model_dir))


def child_prompt_ids(request: bytes, limits: ModelLimits) -> list[int]:
    """``prompt_ids`` in a prompt process, with the tokenizer and template ``child_init`` loaded.

    ``request`` is the serialized ``GenerateRequest`` (generated protobuf classes do not pickle)."""
    _, tokenizer, template = _CHILD
    return prompt_ids(spb.GenerateRequest.FromString(request), limits, tokenizer, template)


def with_token_ids(request: spb.GenerateRequest, ids: list[int]) -> spb.GenerateRequest:
    """A copy of ``request`` whose prompt is ``ids`` (what ``prompt_ids`` made of its text or chat)."""
    out = spb.GenerateRequest()
    out.CopyFrom(request)
    out.ClearField("prompt")
    out.token_ids.ids.extend(ids)
    return out
