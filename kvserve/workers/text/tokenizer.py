"""Text <-> token ids for a model directory (``tokenizer.json`` via the ``tokenizers`` library).

No transformers at runtime: ``Tokenizer`` reads ``tokenizer.json`` plus the few settings it needs
from ``tokenizer_config.json``, ``config.json`` and ``generation_config.json``.
``IncrementalDetokenizer`` turns a stream of output ids into text deltas that never split a
UTF-8 character.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import tokenizers

# What the tokenizers library decodes an incomplete UTF-8 byte sequence to.
REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens kept as left context for the first output deltas: enough for decoders (e.g.
# SentencePiece's Metaspace) whose output for a token depends on what precedes it.
_PROMPT_CONTEXT_TOKENS = 5


class Tokenizer:
    """Encode/decode for one model.

    BOS handling, kept simple: when ``tokenizer_config.json`` has ``add_bos_token``, that flag
    decides and the BOS id is prepended by hand (``tokenizer.json``'s post-processor is skipped);
    when the key is absent, ``tokenizer.json``'s own post-processor decides (Llama-3 and Qwen2
    style files carry their special-token template there).
    """

    def __init__(
        self,
        hf_tokenizer: tokenizers.Tokenizer,
        *,
        eos_token_ids: Sequence[int] = (),
        bos_token_id: int | None = None,
        add_bos_token: bool | None = None,
    ) -> None:
        """
        Args:
            hf_tokenizer: The loaded ``tokenizers.Tokenizer``.
            eos_token_ids: EOS ids, the primary one first (may be empty).
            bos_token_id: BOS id, needed only when ``add_bos_token`` is True.
            add_bos_token: True/False to force BOS on/off; None to defer to the post-processor.

        Raises:
            ValueError: when add_bos_token is True but there is no BOS id.
        """
        if add_bos_token and bos_token_id is None:
            raise ValueError("add_bos_token is set but no BOS token id is known")
        self._tok = hf_tokenizer
        self._eos_token_ids = tuple(eos_token_ids)
        self.bos_token_id = bos_token_id
        self.add_bos_token = add_bos_token
        self._vocab_size = hf_tokenizer.get_vocab_size(with_added_tokens=True)
        # decode([id], skip) of each known id seen so far, one dict per skip_special_tokens value (see
        # ``_decode_one``); at most the vocabulary's size.
        self._one_id_text: dict[bool, dict[int, str]] = {False: {}, True: {}}

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load from an HF model directory.

        Raises:
            FileNotFoundError: when ``model_dir/tokenizer.json`` is missing.
        """
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():  # tokenizers raises a bare Exception here
            raise FileNotFoundError(f"no tokenizer.json in {model_dir}")
        return cls.from_parts(
            tokenizers.Tokenizer.from_file(str(path)),
            tokenizer_config=_read_json(model_dir / "tokenizer_config.json"),
            model_config=_read_json(model_dir / "config.json"),
            generation_config=_read_json(model_dir / "generation_config.json"),
        )

    @classmethod
    def from_parts(
        cls,
        hf_tokenizer: tokenizers.Tokenizer,
        *,
        tokenizer_config: dict,
        model_config: dict,
        generation_config: dict,
    ) -> Tokenizer:
        """Build from a loaded ``tokenizers.Tokenizer`` and the three HF config dicts.

        End ids: every id of config.json's ``eos_token_id``, then generation_config.json's (chat
        models list their end-of-turn token there, e.g. ``[<|im_end|>, <|endoftext|>]``), then
        tokenizer_config.json's ``eos_token``; duplicates dropped, the first is the primary one.
        """
        eos_ids: list[int] = []
        for candidate in (
            _as_id_list(model_config.get("eos_token_id")),
            _as_id_list(generation_config.get("eos_token_id")),
            _as_id_list(_special_token_id(hf_tokenizer, tokenizer_config.get("eos_token"))),
        ):
            eos_ids.extend(i for i in candidate if i not in eos_ids)
        bos_id = _special_token_id(hf_tokenizer, tokenizer_config.get("bos_token"))
        if bos_id is None:
            bos_ids = _as_id_list(model_config.get("bos_token_id"))
            bos_id = bos_ids[0] if bos_ids else None
        add_bos = tokenizer_config.get("add_bos_token")
        return cls(
            hf_tokenizer,
            eos_token_ids=eos_ids,
            bos_token_id=bos_id,
            add_bos_token=None if add_bos is None else bool(add_bos),
        )

    @property
    def eos_token_id(self) -> int | None:
        """The primary EOS id (config.json's, the first when it lists several), or None."""
        return self._eos_token_ids[0] if self._eos_token_ids else None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation (see ``from_parts``), the primary one first."""
        return self._eos_token_ids

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included (may be < the model's vocab)."""
        return self._vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, with BOS per the class's BOS rule; no EOS is added.

        ``add_special_tokens=False``: no BOS and no post-processor (a rendered chat template
        already writes its special tokens, as HF's ``apply_chat_template`` assumes).
        """
        if not add_special_tokens:
            return self._tok.encode(text, add_special_tokens=False).ids
        if self.add_bos_token is None:
            return self._tok.encode(text, add_special_tokens=True).ids
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self.add_bos_token:
            assert self.bos_token_id is not None  # checked in __init__
            ids.insert(0, self.bos_token_id)
        return ids

    @functools.cached_property
    def added_tokens(self) -> dict[str, int]:
        """Every added token (special or not: ``<|im_start|>``, ``<s>``, ``<think>``...) by its text."""
        return {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.content}

    @functools.cached_property
    def added_token_pattern(self) -> re.Pattern[str] | None:
        """One regex matching any added token's text (longest first), None when there is none."""
        texts = sorted(self.added_tokens, key=len, reverse=True)
        return re.compile("|".join(map(re.escape, texts))) if texts else None

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """``encode(text, add_special_tokens=False)`` and each id's ``(start, end)`` characters in ``text``."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of ``text`` as plain text: no added token is matched, so ``"<|im_end|>"`` in
        it becomes the ids of its characters (``decode`` gives the text back), never the control id.

        Raises:
            ValueError: the model's own vocabulary turned part of it into an added token's id
                (no byte-level BPE does; a guard, so a control id never slips through).
        """
        ids = self._plain.encode(text, add_special_tokens=False).ids
        added = set(self.added_tokens.values())
        if any(i in added for i in ids):
            raise ValueError("text cannot be tokenized without a control token")
        return ids

    @functools.cached_property
    def _plain(self) -> tokenizers.Tokenizer:
        # NOTE: the same normalizer, pre-tokenizer and model, with the added vocabulary (which
        # tokenizers matches before anything else) emptied.
        spec = json.loads(self._tok.to_str())
        spec["added_tokens"] = []
        return tokenizers.Tokenizer.from_str(json.dumps(spec))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``. Ids outside the tokenizer's vocabulary (a model's padded vocab rows,
        a random model's output) decode to nothing instead of raising. Incomplete UTF-8 decodes to
        U+FFFD."""
        known = [i for i in ids if 0 <= i < self._vocab_size]
        return self._tok.decode(known, skip_special_tokens=skip_special_tokens)

    def _decode_one(self, token_id: int, skip_special_tokens: bool) -> str:
        """``decode([token_id], skip_special_tokens)``, cached (decoding is a pure function of the ids):
        the detokenizer's prefix window is most often a single id."""
        cache = self._one_id_text[skip_special_tokens]
        text = cache.get(token_id)
        if text is None:
            text = self.decode([token_id], skip_special_tokens)
            if 0 <= token_id < self._vocab_size:  # bounded by the vocabulary
                cache[token_id] = text
        return text


def load_tokenizer(model_dir: str | Path) -> Tokenizer | None:
    """The model's tokenizer, or None when it has none (prompts must then be given as token ids).

    ``model_dir`` is an HF directory (``tokenizer.json``) or a GGUF checkpoint (a ``.gguf`` file or a
    directory holding one), whose tokenizer is rebuilt from its metadata.
    """
    from kvserve.workers.text.gguf_metadata import find_gguf, open_gguf_metadata

    gguf_path = find_gguf(model_dir)
    if gguf_path is not None:
        ckpt = open_gguf_metadata(gguf_path)
        parts = ckpt.tokenizer()
        return Tokenizer.from_parts(
            parts.tokenizer,
            tokenizer_config=parts.tokenizer_config,
            model_config=ckpt.hf_config(),
            generation_config=parts.generation_config,
        )
    if not (Path(model_dir) / "tokenizer.json").is_file():
        return None
    return Tokenizer.from_dir(model_dir)


@dataclass(frozen=True)
class DetokenizerState:
    ids: list[int]
    prefix_offset: int
    read_offset: int
    emitted_in_window: int
    text: str


class IncrementalDetokenizer:
    """Turns output ids, one at a time, into text deltas (vLLM's ``detokenize_incrementally``).

    Keeps two offsets into the ids: text is decoded over ``ids[prefix_offset:]`` and the part
    beyond ``decode(ids[prefix_offset:read_offset])`` is new. Decoding a short window keeps each
    step O(1) and the left context keeps decoders that look at neighbours (leading-space rules)
    right. While the window's text ends in U+FFFD (a multi-byte character split across tokens),
    the incomplete tail is held back, so a delta never carries a broken character.

    Contract: when the output ids form valid UTF-8, ``"".join(deltas) + flush()`` equals
    ``tokenizer.decode(output_ids)`` (given no prompt context; with a prompt, the first delta may
    keep a leading space that a standalone decode would strip).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        """
        Args:
            tokenizer: The model's tokenizer.
            prompt_ids: The prompt, used only as left context (its text is never emitted).
            skip_special_tokens: Leave special tokens (EOS...) out of the text.
        """
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        # Chars beyond decode(ids[prefix:read]) already emitted while the tail was incomplete.
        self._emitted_in_window = 0
        # len(decode(ids[prefix:read])) while the offsets stay put (a held-back tail), else None.
        self._prefix_len: int | None = None
        # Index of the last id outside the vocabulary (-1: none): a window starting after it needs
        # no filtering and goes straight to tokenizers.
        self._last_unknown = _last_unknown_index(self._ids, tokenizer.vocab_size)
        self.text = ""  # everything emitted so far

    def add(self, token_id: int) -> str:
        """Feed the next output id; return the newly complete text (possibly "")."""
        ids = self._ids
        ids.append(token_id)
        tokenizer = self._tokenizer
        if not 0 <= token_id < tokenizer._vocab_size:
            self._last_unknown = len(ids) - 1
        start = self._prefix_offset
        # Every id from the window's start on is known: tokenizers' own decode is Tokenizer.decode.
        decode = tokenizer._tok.decode if self._last_unknown < start else tokenizer.decode
        prefix_len = self._prefix_len
        if prefix_len is None:
            read = self._read_offset
            if read - start == 1:
                prefix_len = len(tokenizer._decode_one(ids[start], self._skip_special))
            else:
                prefix_len = len(decode(ids[start:read], self._skip_special))
            self._prefix_len = prefix_len
        window_text = decode(ids[start:], self._skip_special)
        start = prefix_len + self._emitted_in_window
        if window_text.endswith(REPLACEMENT_CHAR):
            # Emit what precedes the incomplete tail, but keep the window open: the next tokens
            # may turn the trailing U+FFFD into a real character.
            stable_end = len(window_text.rstrip(REPLACEMENT_CHAR))
            delta = window_text[start:stable_end] if stable_end > start else ""
            self._emitted_in_window += len(delta)
        else:
            delta = window_text[start:] if len(window_text) > start else ""
            self._prefix_offset = self._read_offset
            self._read_offset = len(ids)
            self._emitted_in_window = 0
            self._prefix_len = None
        if delta:
            self.text += delta
        return delta

    def flush(self) -> str:
        """At finish: return any held-back tail (with its U+FFFD, as a full decode would show it)."""
        ids, skip, decode = self._ids, self._skip_special, self._tokenizer.decode
        prefix_text = decode(ids[self._prefix_offset : self._read_offset], skip)
        window_text = decode(ids[self._prefix_offset :], skip)
        start = len(prefix_text) + self._emitted_in_window
        delta = window_text[start:] if len(window_text) > start else ""
        self._prefix_offset = self._read_offset = len(ids)
        self._emitted_in_window = 0
        self._prefix_len = None
        self.text += delta
        return delta

    def snapshot(self) -> DetokenizerState:
        """Everything needed to continue elsewhere (migration): the window, its offsets, the text."""
        return DetokenizerState(
            list(self._ids), self._prefix_offset, self._read_offset, self._emitted_in_window, self.text
        )

    @classmethod
    def restore(cls, tokenizer: Tokenizer, state: DetokenizerState) -> IncrementalDetokenizer:
        """Continue from ``snapshot()``: text held back for an incomplete character is still held."""
        detok = cls(tokenizer)
        detok._ids = list(state.ids)
        detok._prefix_offset, detok._read_offset = state.prefix_offset, state.read_offset
        detok._emitted_in_window, detok.text = state.emitted_in_window, state.text
        detok._last_unknown = _last_unknown_index(detok._ids, tokenizer.vocab_size)
        return detok


def _last_unknown_index(ids: Sequence[int], vocab_size: int) -> int:
    """Index of the last id outside ``[0, vocab_size)`` in ``ids``, -1 when there is none."""
    for i in range(len(ids) - 1, -1, -1):
        if not 0 <= ids[i] < vocab_size:
            return i
    return -1


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _as_id_list(value: object) -> list[int]:
    """An id or list of ids from a config, as a list (empty for None/garbage)."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _special_token_id(tok: tokenizers.Tokenizer, token: object) -> int | None:
    """Id of a special token given as in tokenizer_config.json: a string or ``{"content": ...}``."""
    if isinstance(token, dict):
        token = token.get("content")
    if not isinstance(token, str):
        return None
    return tok.token_to_id(token)
