"""check_stop and the stop-string helpers."""

from __future__ import annotations

from kvserve.workers.core.sampling_params import SamplingParams
from kvserve.workers.engine.stop_checker import check_stop, find_stop_string, stop_holdback_len, truncate_at_stop

EOS = 2


def test_keeps_going() -> None:
    assert check_stop([5, 6], "hello", SamplingParams(max_tokens=10), (EOS,), False) is None
    assert check_stop([], None, SamplingParams(), (EOS,), False) is None


def test_eos_stops_unless_ignored() -> None:
    assert check_stop([5, EOS], None, SamplingParams(), (EOS,), False) == "stop"
    assert check_stop([5, EOS], None, SamplingParams(ignore_eos=True), (EOS,), False) is None
    assert check_stop([5, EOS], None, SamplingParams(), (), False) is None  # unknown EOS


def test_any_end_id_stops() -> None:
    """Chat models end a turn with a token other than their primary EOS (<|im_end|> beside <|endoftext|>)."""
    ends = frozenset({EOS, 77})
    assert check_stop([5, 77], None, SamplingParams(), ends, False) == "stop"
    assert check_stop([5, EOS], None, SamplingParams(), ends, False) == "stop"
    assert check_stop([5, 77], None, SamplingParams(ignore_eos=True), ends, False) is None


def test_stop_token_ids() -> None:
    p = SamplingParams(stop_token_ids=(7, 9), ignore_eos=True)
    assert check_stop([1, 9], None, p, (EOS,), False) == "stop"
    assert check_stop([9, 1], None, p, (EOS,), False) is None  # only the newest token counts


def test_length() -> None:
    p = SamplingParams(max_tokens=3)
    assert check_stop([1, 1], None, p, (EOS,), False) is None
    assert check_stop([1, 1, 1], None, p, (EOS,), False) == "length"
    assert check_stop([1], None, p, (EOS,), True) == "length"


def test_eos_on_last_allowed_token_reports_stop() -> None:
    assert check_stop([1, EOS], None, SamplingParams(max_tokens=2), (EOS,), True) == "stop"


def test_stop_strings() -> None:
    p = SamplingParams(stop=("###", "\n\n"))
    assert check_stop([1, 2, 3], "abc ##", p, (), False) is None
    assert check_stop([1, 2, 3], "abc ###", p, (), False) == "stop"
    assert check_stop([1, 2, 3], "abc ###", p, (), False, new_char_count=1) == "stop"
    # The match is older than the tail searched (it was reported on an earlier step).
    assert check_stop([1, 2, 3], "### and more", p, (), False, new_char_count=4) is None
    assert check_stop([1, 2, 3], None, p, (), False) is None  # no tokenizer: no text


def test_find_and_truncate() -> None:
    stops = ("world", "lo")
    assert find_stop_string("hello world", stops) == (3, "lo")
    assert truncate_at_stop("hello world", stops) == "hel"
    assert truncate_at_stop("nothing here", stops) == "nothing here"
    assert find_stop_string("abc", ()) is None


def test_find_stop_spanning_deltas() -> None:
    # "STOP" completed by a delta of 1 char: the search window reaches back len("STOP") - 1 chars.
    assert find_stop_string("text STOP", ("STOP",), new_char_count=1) == (5, "STOP")


def test_holdback() -> None:
    assert stop_holdback_len("hello ST", ("STOP",)) == 2
    assert stop_holdback_len("hello STOP", ("STOP",)) == 0  # complete: check_stop handles it
    assert stop_holdback_len("hello", ("STOP", "lo!")) == 2
    assert stop_holdback_len("hello", ()) == 0
    assert stop_holdback_len("S", ("STOP",)) == 1
