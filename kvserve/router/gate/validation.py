"""Client request validation: every field checked, every error names its field.

Runs before anything is queued or allocated; a ``ValidationError`` becomes INVALID_ARGUMENT.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.workers.core.sampling_params import SamplingParams
from kvserve.workers.text.chat_template import CHAT_ROLES, ChatMessage

MAX_REQUEST_ID_LEN = 128
MAX_TENANT_LEN = 256
MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 256
MAX_TEXT_CHARS = 1 << 20
MAX_CHAT_MESSAGES = 1024
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]+")  # NOTE: fullmatch; "$" would admit a trailing newline


class ValidationError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message

    def __reduce__(self) -> tuple:
        # NOTE: raised in the prompt processes (kvserve/router/gate/prompt_preparer.py) and pickled back to the router
        return type(self), (self.field, self.message)


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    max_model_len: int
    default_max_tokens: int = 256


def validate_ids(request: spb.GenerateRequest) -> None:
    if len(request.request_id) > MAX_REQUEST_ID_LEN or (
        request.request_id and not _REQUEST_ID.fullmatch(request.request_id)
    ):
        raise ValidationError("request_id", f"at most {MAX_REQUEST_ID_LEN} chars of [A-Za-z0-9._:-]")
    if len(request.tenant) > MAX_TENANT_LEN:
        raise ValidationError("tenant", f"at most {MAX_TENANT_LEN} characters")


def validate_prompt_ids(ids: list[int], limits: ModelLimits, field: str = "prompt.token_ids") -> None:
    if not ids:
        raise ValidationError(field, "empty prompt")
    if len(ids) > limits.max_model_len:
        raise ValidationError(field, f"{len(ids)} tokens exceed max_model_len={limits.max_model_len}")
    if min(ids) >= 0 and max(ids) < limits.vocab_size:  # NOTE: C-speed on the common path (router CPU per request)
        return
    bad = next(t for t in ids if not 0 <= t < limits.vocab_size)
    raise ValidationError(field, f"token id {bad} outside [0, {limits.vocab_size})")


def chat_messages(msg: spb.ChatMessages, field: str = "prompt.messages") -> list[ChatMessage]:
    """Proto -> ChatMessage list; raises ValidationError naming ``prompt.messages[i].<field>``.

    Contract: 1..MAX_CHAT_MESSAGES messages, each with a known role (``CHAT_ROLES``) and non-empty
    content, MAX_TEXT_CHARS characters of content in all (checked before the template renders them).
    """
    if not msg.messages:
        raise ValidationError(field, "at least one message")
    if len(msg.messages) > MAX_CHAT_MESSAGES:
        raise ValidationError(field, f"at most {MAX_CHAT_MESSAGES} messages")
    out: list[ChatMessage] = []
    for i, m in enumerate(msg.messages):
        if m.role not in CHAT_ROLES:
            raise ValidationError(f"{field}[{i}].role", f"unknown role {m.role!r}; one of {', '.join(CHAT_ROLES)}")
        if not m.content:
            raise ValidationError(f"{field}[{i}].content", "empty content")
        out.append(ChatMessage(m.role, m.content))
    if sum(len(m.content) for m in out) > MAX_TEXT_CHARS:
        raise ValidationError(field, f"longer than {MAX_TEXT_CHARS} characters in all")
    return out


def sampling_params(msg: spb.SamplingParams, num_prompt_tokens: int, limits: ModelLimits) -> SamplingParams:
    """Proto -> SamplingParams with server defaults; raises ValidationError naming ``sampling.<field>``."""
    room = limits.max_model_len - num_prompt_tokens
    # NOTE: as vLLM: an explicit max_tokens that cannot fit the context is refused, not clamped
    # (a client asking for 2**32-1 tokens has a bug it should hear about). Unset, the server
    # picks what fits (at least 1: a prompt filling the context still gets its next token).
    if msg.max_tokens and msg.max_tokens > room:
        raise ValidationError(
            "sampling.max_tokens",
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({msg.max_tokens}) exceeds "
            f"max_model_len={limits.max_model_len}; at most {max(room, 0)} fits",
        )
    max_tokens = msg.max_tokens or min(limits.default_max_tokens, max(room, 1))
    if not math.isfinite(msg.temperature) or not 0 <= msg.temperature <= 100:
        raise ValidationError("sampling.temperature", f"must be in [0, 100], got {msg.temperature}")
    if msg.top_k >= limits.vocab_size:
        raise ValidationError("sampling.top_k", f"must be < vocab size {limits.vocab_size}")
    if len(msg.stop) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_LEN for s in msg.stop):
        raise ValidationError(
            "sampling.stop", f"at most {MAX_STOP_STRINGS} non-empty strings of <= {MAX_STOP_LEN} chars"
        )
    bad = next((t for t in msg.stop_token_ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise ValidationError("sampling.stop_token_ids", f"token id {bad} outside [0, {limits.vocab_size})")
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=msg.temperature,
            top_k=msg.top_k,
            top_p=msg.top_p if msg.HasField("top_p") else 1.0,
            seed=msg.seed if msg.HasField("seed") else None,
            stop=tuple(msg.stop),
            stop_token_ids=tuple(msg.stop_token_ids),
            ignore_eos=msg.ignore_eos,
            logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        )
    except ValueError as e:
        raise ValidationError("sampling", str(e)) from e
