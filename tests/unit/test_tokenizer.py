"""Tokenizer loading/encoding and IncrementalDetokenizer (on the random model's tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.workers.models.random_model import BOS_ID, EOS_ID, VOCAB_SIZE, write_tokenizer
from kvserve.workers.text.tokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, Tokenizer, load_tokenizer

TEXT = "Hello, world! héllo ✓ 你好 🙂"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> Tokenizer:
    t = load_tokenizer(tok_dir)
    assert t is not None
    return t


def _stream(tok: Tokenizer, ids: list[int], prompt_ids: tuple[int, ...] = ()) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok, prompt_ids)
    deltas = [detok.add(i) for i in ids]
    tail = detok.flush()
    assert detok.text == "".join(deltas) + tail
    return deltas, tail


def test_load_none_without_tokenizer_json(tmp_path: Path) -> None:
    assert load_tokenizer(tmp_path) is None
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_dir(tmp_path)


def test_basic_properties(tok: Tokenizer) -> None:
    assert tok.vocab_size == VOCAB_SIZE
    assert tok.eos_token_id == EOS_ID  # from tokenizer_config.json's eos_token (no config.json here)
    assert tok.bos_token_id == BOS_ID


def test_encode_adds_bos_and_round_trips(tok: Tokenizer) -> None:
    ids = tok.encode(TEXT)
    assert ids[0] == BOS_ID and ids.count(BOS_ID) == 1
    assert tok.decode(ids) == TEXT
    assert tok.decode(ids, skip_special_tokens=False) == "<s>" + TEXT


def test_eos_from_config_json_list(tmp_path: Path, tok_dir: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tok_dir / name).read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [7, EOS_ID]}))
    t = Tokenizer.from_dir(tmp_path)
    assert t.eos_token_id == 7 and t.eos_token_ids == (7, EOS_ID)


def test_bos_defers_to_post_processor_without_flag(tmp_path: Path, tok_dir: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    t = Tokenizer.from_dir(tmp_path)  # no tokenizer_config.json: template post-processor adds <s>
    assert t.add_bos_token is None and t.encode("hi")[0] == BOS_ID
    assert t.eos_token_id is None


def test_matches_transformers(tok_dir: Path, tok: Tokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / "tokenizer.json"))
    for text in (TEXT, " leading space", "a\n\nb\tc", ""):
        assert tok.encode(text) == hf.encode(text)


def test_unknown_ids_do_not_crash(tok: Tokenizer) -> None:
    assert tok.decode([VOCAB_SIZE, 40000, -1]) == ""
    hello = tok.encode("hello")[1:]
    deltas, tail = _stream(tok, [hello[0], 40000, *hello[1:], VOCAB_SIZE + 5])
    assert "".join(deltas) + tail == "hello"


def test_split_multibyte_chars_never_emit_replacement(tok: Tokenizer) -> None:
    ids = tok.encode(TEXT)[1:]
    # The random tokenizer has no non-ASCII merges: every multi-byte char spans several tokens.
    assert len(ids) > len(TEXT.encode("ascii", "ignore"))
    deltas, tail = _stream(tok, ids)
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert "".join(deltas) == TEXT and tail == ""
    assert any(d == "✓" for d in deltas)  # emitted whole once its third byte arrived


def test_eos_is_skipped_in_text(tok: Tokenizer) -> None:
    ids = tok.encode("bye")[1:] + [EOS_ID]
    deltas, _ = _stream(tok, ids)
    assert "".join(deltas) == "bye" and deltas[-1] == ""


def test_prompt_context_is_not_emitted(tok: Tokenizer) -> None:
    prompt = tuple(tok.encode("The answer is"))
    out = tok.encode(" forty-two")[1:]
    deltas, tail = _stream(tok, out, prompt)
    assert "".join(deltas) + tail == " forty-two"


def test_incomplete_tail_is_flushed(tok: Tokenizer) -> None:
    ids = tok.encode("ok ✓")[1:-1]  # drop the last byte of ✓
    deltas, tail = _stream(tok, ids)
    assert "".join(deltas) == "ok " and tail == REPLACEMENT_CHAR
    assert "".join(deltas) + tail == tok.decode(ids)


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=40))
def test_deltas_concatenate_to_text(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)[1:]
    deltas, tail = _stream(tok, ids)
    assert all(REPLACEMENT_CHAR not in d for d in deltas) or REPLACEMENT_CHAR in text
    assert "".join(deltas) + tail == text


@settings(max_examples=60, deadline=None)
@given(
    ids=st.lists(
        # Ids 3..258 are the single-byte tokens: weight them so broken UTF-8 is common.
        st.one_of(
            st.integers(min_value=3, max_value=258), st.integers(min_value=0, max_value=VOCAB_SIZE + 100)
        ),
        max_size=40,
    )
)
def test_random_ids_do_not_crash(tok: Tokenizer, ids: list[int]) -> None:
    # Random models emit any id, including lone UTF-8 continuation bytes and out-of-vocab ids.
    deltas, tail = _stream(tok, ids)
    # Byte-level decoding never rewrites a complete character, so even invalid UTF-8 adds up.
    assert "".join(deltas) + tail == tok.decode(ids)


def test_snapshot_restore_mid_character_continues_the_text(tok: Tokenizer) -> None:
    """Migration moves the detokenizer between workers: a cut inside a multi-byte character must
    not lose or duplicate text."""
    text = "héllo ✓ wörld 🙂!"
    ids = tok.encode(text)
    if tok.bos_token_id is not None and ids and ids[0] == tok.bos_token_id:
        ids = ids[1:]
    for cut in range(1, len(ids)):
        first = IncrementalDetokenizer(tok)
        out = "".join(first.add(i) for i in ids[:cut])
        second = IncrementalDetokenizer.restore(tok, first.snapshot())
        out += "".join(second.add(i) for i in ids[cut:]) + second.flush()
        assert out == text, f"cut at {cut}"


def test_end_ids_join_config_generation_config_and_eos_token(tmp_path) -> None:
    """A chat model's end of turn (generation_config.json's list) stops it beside config.json's EOS."""
    write_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 7]}))
    t = Tokenizer.from_dir(tmp_path)
    assert t.eos_token_id == 7 and t.eos_token_ids == (7, 9, EOS_ID)  # EOS_ID: tokenizer_config's eos_token
