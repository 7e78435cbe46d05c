"""Chat messages -> prompt text, rendering the model's own Jinja chat template as HF transformers does.

The template is ``tokenizer_config.json``'s ``chat_template`` (a string, or HF's list of named
templates, of which ``default`` is used) or, when present, ``chat_template.jinja`` in the model
directory (newer HF checkpoints keep it there; it wins, as in transformers). It is rendered in
jinja2's ``ImmutableSandboxedEnvironment`` (a template is model-supplied data: it must not reach
Python internals) with HF's settings: ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols``
extension, a ``tojson`` filter that keeps non-ASCII, the ``raise_exception`` and ``strftime_now``
globals, and ``messages``, ``add_generation_prompt`` and the special tokens (``bos_token``,
``eos_token``, ...) in the context.

The rendered text already holds whatever special tokens the template writes (BOS included), so it
is tokenized without adding special tokens (``Tokenizer.encode(text, add_special_tokens=False)``),
as ``apply_chat_template(tokenize=True)`` does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Roles a chat request may use (OpenAI's, less the tool-calling ones this server does not run).
CHAT_ROLES = ("system", "user", "assistant", "developer")
TEMPLATE_FILE = "chat_template.jinja"
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The template failed to render these messages (its own ``raise_exception``, or a Jinja error)."""


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    # NOTE: HF's filter, not jinja2's: jinja2's escapes HTML characters and non-ASCII.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class ChatTemplate:
    """One model's compiled chat template plus the special tokens its context carries."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        """
        Args:
            source: the Jinja template text.
            special_tokens: e.g. ``{"bos_token": "<s>", "eos_token": "</s>"}`` (context variables).

        Raises:
            ChatTemplateError: the template does not compile.
        """
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template does not compile: {e}") from e
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ChatTemplate | None:
        """The model directory's template (``chat_template.jinja`` first, then
        ``tokenizer_config.json``'s), or None when it has none.

        Raises:
            ChatTemplateError: a template is there but does not compile.
        """
        from kvserve.workers.text.gguf_metadata import find_gguf, open_gguf_metadata

        gguf = find_gguf(model_dir)
        if gguf is not None:  # a GGUF checkpoint carries its template in its metadata
            return cls.from_config(open_gguf_metadata(gguf).tokenizer().tokenizer_config)
        model_dir = Path(model_dir)
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        jinja_path = model_dir / TEMPLATE_FILE
        if jinja_path.is_file():
            config = {**config, "chat_template": jinja_path.read_text()}
        return cls.from_config(config)

    @classmethod
    def from_config(cls, tokenizer_config: Mapping[str, Any]) -> ChatTemplate | None:
        """From a ``tokenizer_config.json`` dict (e.g. one rebuilt from GGUF metadata); None when it
        has no ``chat_template``.

        Raises:
            ChatTemplateError: the template does not compile.
        """
        source = tokenizer_config.get("chat_template")
        if isinstance(source, list):  # HF's named templates: [{"name": ..., "template": ...}]
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        if not isinstance(source, str) or not source:
            return None
        tokens = {k: t for k in _SPECIAL_TOKEN_KEYS if (t := _token_text(tokenizer_config.get(k))) is not None}
        return cls(source, tokens)

    def render(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> str:
        """The prompt text for ``messages`` (the assistant's turn opened when ``add_generation_prompt``).

        Raises:
            ChatTemplateError: the template raised (e.g. roles out of order) or failed to render.
        """
        chat = [{"role": m.role, "content": m.content} for m in messages]
        try:
            return self._template.render(
                # NOTE: tools/documents None, as HF passes them: `tools is not none` must be False.
                messages=chat,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except jinja2.TemplateError as e:  # SecurityError (sandbox) is a TemplateError too
            raise ChatTemplateError(f"chat template failed: {e}") from e
