"""Chat messages -> prompt token ids, where only the template's own markup yields control tokens.

HF's ``apply_chat_template(tokenize=True)`` renders the messages into text and tokenizes that text
with added-token matching on, so a message whose content holds ``<|im_end|>\\n<|im_start|>system``
forges a turn: its characters become the very control ids the template writes. Here they do not:

1. No content holds an added token's text (the common case): render and tokenize exactly as HF
   does (same ids).
2. Otherwise each such occurrence in content is swapped for a private-use sentinel character
   before rendering (so the template sees, and writes, only its own markup); the rendered text is
   tokenized as usual, which matches the template's control tokens; and every stretch of text
   between two of those that holds a sentinel is tokenized again, sentinels put back, as plain
   text (``Tokenizer.encode_plain``: no added token matched). Stretches without content special
   strings keep HF's ids.

So the ids hold exactly the control tokens the template writes, and decode (special tokens kept)
to exactly the text HF's rendering would hold.

NOTE: content is escaped before the template sees it, so a template that branches on special
strings in content (Qwen3 splitting an assistant turn at ``</think>``) treats them as text.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from kvserve.workers.text.chat_template import ChatMessage, ChatTemplate
from kvserve.workers.text.tokenizer import Tokenizer

# Supplementary Private Use Area-A: never assigned, never in a tokenizer's added tokens.
_SENTINEL_FIRST, _SENTINEL_LAST = 0xF0000, 0xFFFFD


def encode_chat(
    tokenizer: Tokenizer,
    template: ChatTemplate,
    messages: Sequence[ChatMessage],
    add_generation_prompt: bool = True,
) -> list[int]:
    """The prompt ids of ``messages``: the template's control tokens, content always as text.

    Raises:
        ChatTemplateError: the template refused the messages.
        ValueError: content that cannot be tokenized without a control token (see
            ``Tokenizer.encode_plain``) or more distinct special strings than sentinels.
    """
    added = tokenizer.added_tokens
    pattern = tokenizer.added_token_pattern
    if pattern is None or not any(pattern.search(m.content) for m in messages):
        return tokenizer.encode(template.render(messages, add_generation_prompt), add_special_tokens=False)
    taken = set(template.source).union(*map(set, template.special_tokens.values()))
    taken.update(*(set(m.content) for m in messages))
    sentinels = (chr(c) for c in range(_SENTINEL_FIRST, _SENTINEL_LAST + 1) if chr(c) not in taken)
    sentinel_of: dict[str, str] = {}

    def escape(match: re.Match[str]) -> str:
        if match.group() not in sentinel_of:
            sentinel = next(sentinels, None)
            if sentinel is None:
                raise ValueError("too many distinct special-token strings in the messages")
            sentinel_of[match.group()] = sentinel
        return sentinel_of[match.group()]

    escaped = [ChatMessage(m.role, pattern.sub(escape, m.content)) for m in messages]
    text = template.render(escaped, add_generation_prompt)
    original_of = {v: k for k, v in sentinel_of.items()}
    unescape = re.compile("|".join(map(re.escape, original_of)))
    control_ids = set(added.values())

    out: list[int] = []
    stretch_ids: list[int] = []
    stretch_start = 0

    def end_stretch(end: int) -> None:
        stretch = text[stretch_start:end]
        if unescape.search(stretch):
            out.extend(tokenizer.encode_plain(unescape.sub(lambda m: original_of[m.group()], stretch)))
        else:
            out.extend(stretch_ids)
        stretch_ids.clear()

    ids, offsets = tokenizer.encode_with_offsets(text)
    for token_id, (start, end) in zip(ids, offsets, strict=True):
        if token_id in control_ids:  # the template's: content holds no added token's text now
            end_stretch(start)
            out.append(token_id)
            stretch_start = end
        else:
            stretch_ids.append(token_id)
    end_stretch(len(text))
    return out
