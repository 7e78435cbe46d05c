"""IncrementalDetokenizer against a frozen copy of its original algorithm, delta by delta.

The detokenizer's fast paths (a cached single-id prefix decode, no id filtering when every id in the
window is known, the prefix length kept while a held-back tail keeps the offsets put) must not change a
single output: every delta, ``text``, ``flush()`` and ``snapshot()`` must be what the straightforward
algorithm (vLLM's, two filtered decodes per token) gives, on byte-level BPE (SmolLM2 when the model
cache holds it, a small trained one, the random model's) and on a SentencePiece-style byte-fallback
tokenizer whose decoder strips a leading space (so the prompt context matters), with special and added
tokens, out-of-vocab ids, split multi-byte characters, flushes and snapshot/restore at random points.
"""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Sequence
from dataclasses import astuple, dataclass

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from kvserve.cluster.model_fetch import default_model_dir
from kvserve.workers.models.random_model import build_tokenizer
from kvserve.workers.text.tokenizer import DetokenizerState, IncrementalDetokenizer, Tokenizer

# ---------------------------------------------------------------------------------------------
# The reference: IncrementalDetokenizer and Tokenizer.decode as they were before the fast paths
# (kvserve/workers/text/tokenizer.py at 88361fb), verbatim but for the names.

_REPLACEMENT_CHAR = "\ufffd"
_PROMPT_CONTEXT_TOKENS = 5


def _ref_decode(tok: Tokenizer, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    vocab_size = tok._tok.get_vocab_size(with_added_tokens=True)
    known = [i for i in ids if 0 <= i < vocab_size]
    return tok._tok.decode(known, skip_special_tokens=skip_special_tokens)


@dataclass(frozen=True)
class _RefState:
    ids: list[int]
    prefix_offset: int
    read_offset: int
    emitted_in_window: int
    text: str


class _RefDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._emitted_in_window = 0
        self.text = ""

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_text, window_text = self._decode_window()
        start = len(prefix_text) + self._emitted_in_window
        if window_text.endswith(_REPLACEMENT_CHAR):
            stable_end = len(window_text.rstrip(_REPLACEMENT_CHAR))
            delta = window_text[start:stable_end] if stable_end > start else ""
            self._emitted_in_window += len(delta)
        else:
            delta = window_text[start:] if len(window_text) > start else ""
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self._emitted_in_window = 0
        self.text += delta
        return delta

    def flush(self) -> str:
        prefix_text, window_text = self._decode_window()
        start = len(prefix_text) + self._emitted_in_window
        delta = window_text[start:] if len(window_text) > start else ""
        self._prefix_offset = self._read_offset = len(self._ids)
        self._emitted_in_window = 0
        self.text += delta
        return delta

    def snapshot(self) -> _RefState:
        return _RefState(list(self._ids), self._prefix_offset, self._read_offset, self._emitted_in_window, self.text)

    @classmethod
    def restore(cls, tokenizer: Tokenizer, state: _RefState) -> _RefDetokenizer:
        detok = cls(tokenizer)
        detok._ids = list(state.ids)
        detok._prefix_offset, detok._read_offset = state.prefix_offset, state.read_offset
        detok._emitted_in_window, detok.text = state.emitted_in_window, state.text
        return detok

    def _decode_window(self) -> tuple[str, str]:
        ids, skip = self._ids, self._skip_special
        prefix_text = _ref_decode(self._tokenizer, ids[self._prefix_offset : self._read_offset], skip)
        window_text = _ref_decode(self._tokenizer, ids[self._prefix_offset :], skip)
        return prefix_text, window_text


# ---------------------------------------------------------------------------------------------
# Tokenizers

_WORDS = (
    "the~ the~ quick~ brown~ fox~ jumps~over~ lazy~ dog~.~,~!~?~ ~  ~\n~\n\n~\t~Hello~ world~ héllo~ wörld~ naïve"
    "~ café~ ✓~✓~ 你好~你好世界~ 🙂~🙂🙂~ 👍🏽~ Ωμέγα~ привет~ 1234~ x=1;"
    "~<think>~</think>~<s>~</s>~<|im_end|>~ ’~—~ ¿qué?"
).split("~")
_CORPUS = ["".join(random.Random(i).choices(_WORDS, k=40)) for i in range(200)]


def _byte_level_bpe() -> tokenizers.Tokenizer:
    """A trained byte-level BPE: common multi-byte characters merged, rare ones split into byte tokens."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    tok.add_special_tokens(["<|im_end|>"])
    tok.add_tokens(["<think>", "</think>"])  # added, not special: kept with skip_special_tokens
    return tok


def _sentencepiece_like() -> tokenizers.Tokenizer:
    """Llama-2 style: Metaspace, BPE with byte fallback (<0xNN> tokens), a decoder that strips the
    leading space of the decoded text (so a window's text depends on what precedes it)."""
    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=40, show_progress=False
    )
    tok.train_from_iterator(_CORPUS, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    spec["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ],
    }
    tok = tokenizers.Tokenizer.from_str(json.dumps(spec))
    tok.add_tokens(["<think>"])
    return tok


def _smollm2() -> tokenizers.Tokenizer:
    path = default_model_dir("smollm2-135m-instruct") / "tokenizer.json"
    if not path.is_file():  # never fetched here: the model tests' fixture does that
        pytest.skip(f"SmolLM2 not in the model cache ({path})")
    return tokenizers.Tokenizer.from_file(str(path))


TOKENIZERS = {
    "byte_level_bpe": _byte_level_bpe,
    "sentencepiece_like": _sentencepiece_like,
    "random_model": build_tokenizer,
    "smollm2": _smollm2,
}


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def tok(request: pytest.FixtureRequest) -> Tokenizer:
    return Tokenizer(TOKENIZERS[request.param]())


def _has_partial_char_tokens(tok: Tokenizer) -> bool:
    """Some token's bytes are text followed by the start of a multi-byte character (byte-level BPE
    merges such): the only way text is emitted while a tail is held back."""
    return any(
        (t := tok.decode([i], skip_special_tokens=False)).endswith("\ufffd") and t.rstrip("\ufffd")
        for i in range(tok.vocab_size)
    )


# ---------------------------------------------------------------------------------------------
# Sequences


@functools.cache
def _byte_ids(tok: Tokenizer) -> list[int]:
    """Ids of single-byte tokens (``<0xNN>`` byte fallback, byte-level BPE's non-ASCII byte chars)."""
    return sorted(i for t, i in tok._tok.get_vocab().items() if t.startswith("<0x") or (len(t) == 1 and ord(t) > 127))


def _random_ids(rng: random.Random, tok: Tokenizer, n: int) -> list[int]:
    """Ids as a random model emits them: anything in the vocabulary, special and added ids, byte tokens
    (broken UTF-8), ids past the vocabulary (padded rows) and, rarely, a negative one."""
    vocab = tok.vocab_size
    added = sorted(tok.added_tokens.values())
    byte_ids = _byte_ids(tok)
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.45:
            out.append(rng.randrange(vocab))
        elif r < 0.75 and byte_ids:
            out.append(rng.choice(byte_ids))
        elif r < 0.85 and added:
            out.append(rng.choice(added))
        elif r < 0.97:
            out.append(vocab + rng.randrange(64))
        else:
            out.append(-1)
    return out


def _text_ids(rng: random.Random, tok: Tokenizer, n_words: int) -> list[int]:
    return tok.encode("".join(rng.choices(_WORDS, k=n_words)), add_special_tokens=False)


def _sequence(rng: random.Random, tok: Tokenizer) -> list[int]:
    """Mostly real text (with multi-byte characters cut at random), spiced with random ids."""
    ids: list[int] = []
    while len(ids) < 60:
        r = rng.random()
        if r < 0.6:
            part = _text_ids(rng, tok, rng.randrange(1, 12))
            if rng.random() < 0.3 and part:
                part = part[: rng.randrange(len(part))]  # may end inside a character
            ids += part
        else:
            ids += _random_ids(rng, tok, rng.randrange(1, 6))
    return ids


def _assert_same_state(new: IncrementalDetokenizer, ref: _RefDetokenizer) -> DetokenizerState:
    state = new.snapshot()
    assert isinstance(state, DetokenizerState)
    assert astuple(state) == astuple(ref.snapshot())
    return state


def _drive(rng: random.Random, tok: Tokenizer, prompt: list[int], ids: list[int], skip: bool) -> dict[str, int]:
    seen = {"held": 0, "emitted_mid_window": 0, "flushes": 0, "restores": 0, "cross_restores": 0}
    new = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    ref = _RefDetokenizer(tok, prompt, skip_special_tokens=skip)
    for step, token_id in enumerate(ids):
        read_before = ref._read_offset
        delta = new.add(token_id)
        assert delta == ref.add(token_id), f"step {step}"
        assert new.text == ref.text
        seen["held"] += ref._read_offset == read_before
        seen["emitted_mid_window"] += ref._emitted_in_window > 0
        r = rng.random()
        if r < 0.04:
            assert new.flush() == ref.flush(), f"flush after step {step}"
            seen["flushes"] += 1
        elif r < 0.16:
            state = _assert_same_state(new, ref)
            ref_state = ref.snapshot()
            if rng.random() < 0.5:
                new = IncrementalDetokenizer.restore(tok, state)
                seen["restores"] += 1
            else:  # a snapshot taken by the original code continues identically too
                new = IncrementalDetokenizer.restore(tok, DetokenizerState(*astuple(ref_state)))
                seen["cross_restores"] += 1
            ref = _RefDetokenizer.restore(tok, ref_state)
        _assert_same_state(new, ref)
    assert new.flush() == ref.flush()
    assert new.text == ref.text
    _assert_same_state(new, ref)
    return seen


def test_matches_the_original_algorithm(tok: Tokenizer) -> None:
    rng = random.Random(1234)
    totals: dict[str, int] = {}
    for _ in range(80):
        prompt_kind = rng.random()
        if prompt_kind < 0.3:
            prompt: list[int] = []
        elif prompt_kind < 0.8:
            prompt = _text_ids(rng, tok, rng.randrange(1, 10))
        else:
            prompt = _random_ids(rng, tok, rng.randrange(1, 9))
        seen = _drive(rng, tok, prompt, _sequence(rng, tok), skip=rng.random() < 0.6)
        for k, v in seen.items():
            totals[k] = totals.get(k, 0) + v
    # The paths that matter were exercised: held-back tails, text emitted while a tail was held,
    # flushes and both kinds of restore.
    if not _has_partial_char_tokens(tok):
        del totals["emitted_mid_window"]
    assert all(v > 0 for v in totals.values()), totals


def test_plain_text_streams_match(tok: Tokenizer) -> None:
    """Long runs of real text without interruptions: the cached single-id prefix path all along."""
    rng = random.Random(99)
    for skip in (True, False):
        for _ in range(8):
            ids = _text_ids(rng, tok, 80)
            _drive(random.Random(0), tok, _text_ids(rng, tok, 6), ids, skip)


def test_single_id_cache_is_decode(tok: Tokenizer) -> None:
    ids = list(range(min(tok.vocab_size, 2000))) + [tok.vocab_size, tok.vocab_size + 7, -1]
    for skip in (True, False):
        for _ in range(2):  # the second round reads the cache
            for i in ids:
                assert tok._decode_one(i, skip) == _ref_decode(tok, [i], skip)
    assert all(0 <= i < tok.vocab_size for cache in tok._one_id_text.values() for i in cache)
