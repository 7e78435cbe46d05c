"""A request's prompt as token ids: given as ids, as text (tokenized), or as chat messages (rendered
with the model's chat template, then tokenized). Pure: no router state, no I/O."""

from __future__ import annotations

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
    raise ValidationError("prompt", "set prompt.text, prompt.token_ids or prompt.messages")


def with_token_ids(request: spb.GenerateRequest, ids: list[int]) -> spb.GenerateRequest:
    """A copy of ``request`` whose prompt is ``ids`` (what ``prompt_ids`` made of its text or chat)."""
    out = spb.GenerateRequest()
    out.CopyFrom(request)
    out.ClearField("prompt")
    out.token_ids.ids.extend(ids)
    return out
