"""When does a request finish? EOS, stop token ids, stop strings, max_tokens, model length.

Pure functions over plain values (no torch, no tokenizer), called once per request per step
after the new token was appended; ``advance_output`` drives a detokenizer given to it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

from kvserve.workers.core.sampling_params import SamplingParams

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


def check_stop(
    output_token_ids: list[int],
    new_text: str | None,
    params: SamplingParams,
    eos_token_ids: Collection[int],
    max_model_len_reached: bool,
    *,
    new_char_count: int | None = None,
) -> str | None:
    """The finish reason after the latest token, or None to keep generating.

    Checked in this order, so an EOS that lands exactly on max_tokens reports "stop":
    EOS (unless ``ignore_eos``), ``stop_token_ids``, stop strings, then max_tokens and the
    model length.

    Args:
        output_token_ids: Output ids so far, the newest last (prompt excluded).
        new_text: The decoded output text so far (all of it, not only the latest delta), or None
            when the model has no tokenizer; stop strings are then not checked.
        params: The request's sampling parameters.
        eos_token_ids: The ids that end generation (EOS, end of turn); empty when unknown.
        max_model_len_reached: True when prompt + output fill the model's context.
        new_char_count: Characters the latest token added to ``new_text``; when given, only the
            tail that could contain a new match is searched (O(1) per step instead of O(text)).
            Matches wholly inside older text were reported on earlier steps.

    Returns:
        "stop", "length" or None. On "stop" from a stop string, cut the user-visible text with
        ``truncate_at_stop``.
    """
    if output_token_ids:
        last = output_token_ids[-1]
        if last in eos_token_ids and not params.ignore_eos:
            return FINISH_STOP
        if last in params.stop_token_ids:
            return FINISH_STOP
    if new_text is not None and params.stop:
        if find_stop_string(new_text, params.stop, new_char_count) is not None:
            return FINISH_STOP
    if len(output_token_ids) >= params.max_tokens or max_model_len_reached:
        return FINISH_LENGTH
    return None


def find_stop_string(
    text: str, stop: Sequence[str], new_char_count: int | None = None
) -> tuple[int, str] | None:
    """The earliest stop string occurrence in ``text`` as ``(position, stop_string)``, or None.

    Args:
        text: The decoded output so far.
        stop: Stop strings (non-empty).
        new_char_count: When given, only occurrences that overlap the last ``new_char_count``
            characters are considered (older ones were found on earlier steps).
    """
    best: tuple[int, str] | None = None
    for s in stop:
        start = 0
        if new_char_count is not None:
            # A match touching the new chars starts at most len(s) - 1 chars before them.
            start = max(0, len(text) - new_char_count - len(s) + 1)
        pos = text.find(s, start)
        if pos != -1 and (best is None or pos < best[0]):
            best = (pos, s)
    return best


def truncate_at_stop(text: str, stop: Sequence[str]) -> str:
    """``text`` cut before the earliest stop string (the stop string is not returned to the user);
    ``text`` unchanged when none occurs."""
    found = find_stop_string(text, stop)
    return text if found is None else text[: found[0]]


def stop_holdback_len(text: str, stop: Sequence[str]) -> int:
    """How many trailing chars of ``text`` to hold back from a stream: the longest suffix that is a
    proper prefix of some stop string, since the next token may complete it (and then it must
    never have been shown). 0 when no stop strings or no such suffix."""
    longest = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


class TextSource(Protocol):
    """What ``advance_output`` needs of an incremental detokenizer (``IncrementalDetokenizer``)."""

    text: str

    def add(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


def advance_output(
    output_token_ids: list[int],
    detokenizer: TextSource | None,
    shown_text: str,
    params: SamplingParams,
    eos_token_ids: Collection[int],
    max_model_len_reached: bool,
) -> tuple[str | None, str]:
    """Account for the newest output token: detokenize it, check every stop rule, and cut the text
    the client may see now.

    The one place that turns a token into (finish reason, visible text): the engine calls it per
    sampled token, and a replay calls it over the already-streamed tokens to rebuild exactly the
    state the original worker had (detokenizer window, text held back mid-match of a stop string).

    Args:
        output_token_ids: Output ids so far, the newest last (already appended).
        detokenizer: The request's detokenizer (advanced here by one token), or None without a
            tokenizer (then only token-level rules apply and no text is produced).
        shown_text: Text already handed out before this token.
        params: The request's sampling parameters.
        eos_token_ids: The ids that end generation (EOS, end of turn); empty when unknown.
        max_model_len_reached: True when prompt + output fill the model's context.

    Returns:
        ``(finish_reason or None, text delta to hand out now)``. Text that may be the start of a
        stop string is held back until the next token decides; at finish it is flushed (or cut
        before the stop string).
    """
    token = output_token_ids[-1]
    text = new_chars = None
    if detokenizer is not None:
        new_chars = len(detokenizer.add(token))
        text = detokenizer.text
    reason = check_stop(
        output_token_ids, text, params, eos_token_ids, max_model_len_reached, new_char_count=new_chars
    )
    visible = ""
    if detokenizer is not None:
        if reason is not None:
            detokenizer.flush()
            visible = truncate_at_stop(detokenizer.text, params.stop) if params.stop else detokenizer.text
        else:
            visible = detokenizer.text[: len(detokenizer.text) - stop_holdback_len(detokenizer.text, params.stop)]
    return reason, visible[len(shown_text) :]
