"""kvserve/router/gate/validation.py: every rule, and that every error names its field."""

from __future__ import annotations

import math

import pytest

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.router.gate.validation import (
    MAX_REQUEST_ID_LEN,
    MAX_STOP_LEN,
    MAX_STOP_STRINGS,
    MAX_TENANT_LEN,
    ModelLimits,
    ValidationError,
    sampling_params,
    validate_ids,
    validate_prompt_ids,
)
from kvserve.workers.core.sampling_params import SamplingParams

LIMITS = ModelLimits(vocab_size=1000, max_model_len=512, default_max_tokens=64)


def sp(**fields) -> spb.SamplingParams:
    return spb.SamplingParams(**fields)


def field_of(excinfo: pytest.ExceptionInfo) -> str:
    return excinfo.value.field


# ---- ValidationError -----------------------------------------------------------------------------
def test_validation_error_names_its_field_and_is_a_value_error():
    e = ValidationError("sampling.top_k", "too big")
    assert isinstance(e, ValueError)
    assert e.field == "sampling.top_k"
    assert str(e) == "sampling.top_k: too big"


# ---- request_id / tenant ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "request_id",
    ["", "a", "req-1", "A.b_c:d-9", "x" * MAX_REQUEST_ID_LEN, "0123456789"],
)
def test_valid_request_ids(request_id):
    validate_ids(spb.GenerateRequest(request_id=request_id))


@pytest.mark.parametrize(
    "request_id",
    [
        "has space",
        "semi;colon",
        "slash/x",
        "new\nline",
        "trailing-newline\n",  # "$" in a regex admits it; the whole id must match
        "\nleading",
        "ünïcode",
        "quote'",
        "x" * (MAX_REQUEST_ID_LEN + 1),
        "\x00",
    ],
)
def test_bad_request_ids(request_id):
    with pytest.raises(ValidationError) as e:
        validate_ids(spb.GenerateRequest(request_id=request_id))
    assert field_of(e) == "request_id"
    assert str(MAX_REQUEST_ID_LEN) in str(e.value)


def test_tenant_length():
    validate_ids(spb.GenerateRequest(tenant="t" * MAX_TENANT_LEN))
    validate_ids(spb.GenerateRequest(tenant="any chars / are ok ü"))
    with pytest.raises(ValidationError) as e:
        validate_ids(spb.GenerateRequest(tenant="t" * (MAX_TENANT_LEN + 1)))
    assert field_of(e) == "tenant"


def test_request_id_checked_before_tenant():
    with pytest.raises(ValidationError) as e:
        validate_ids(spb.GenerateRequest(request_id="bad id", tenant="t" * (MAX_TENANT_LEN + 1)))
    assert field_of(e) == "request_id"


# ---- prompt token ids ------------------------------------------------------------------------------
def test_valid_prompt_ids():
    validate_prompt_ids([0, 1, LIMITS.vocab_size - 1], LIMITS)
    validate_prompt_ids([5] * LIMITS.max_model_len, LIMITS)


def test_empty_prompt():
    with pytest.raises(ValidationError) as e:
        validate_prompt_ids([], LIMITS)
    assert field_of(e) == "prompt.token_ids"
    assert "empty" in str(e.value)


def test_prompt_longer_than_max_model_len():
    with pytest.raises(ValidationError) as e:
        validate_prompt_ids([5] * (LIMITS.max_model_len + 1), LIMITS)
    assert field_of(e) == "prompt.token_ids"
    assert "max_model_len=512" in str(e.value)


@pytest.mark.parametrize("bad", [-1, LIMITS.vocab_size, LIMITS.vocab_size + 7, -(2**31)])
def test_prompt_token_out_of_vocab(bad):
    with pytest.raises(ValidationError) as e:
        validate_prompt_ids([1, 2, bad, 3], LIMITS)
    assert field_of(e) == "prompt.token_ids"
    assert f"token id {bad} " in str(e.value)


def test_prompt_field_name_is_the_callers():
    with pytest.raises(ValidationError) as e:
        validate_prompt_ids([], LIMITS, "prompt.text")
    assert field_of(e) == "prompt.text"


def test_prompt_length_checked_before_token_range():
    # A huge hostile prompt is refused on its length without scanning every id.
    with pytest.raises(ValidationError) as e:
        validate_prompt_ids([-1] * (LIMITS.max_model_len + 1), LIMITS)
    assert "max_model_len" in str(e.value)


# ---- sampling: defaults ----------------------------------------------------------------------------
def test_defaults_from_an_empty_message():
    p = sampling_params(sp(), 10, LIMITS)
    assert p == SamplingParams(
        max_tokens=LIMITS.default_max_tokens,
        temperature=0.0,
        top_k=0,
        top_p=1.0,
        seed=None,
        stop=(),
        stop_token_ids=(),
        ignore_eos=False,
    )
    assert p.greedy


def test_default_max_tokens_is_capped_by_room_left():
    assert sampling_params(sp(), LIMITS.max_model_len - 5, LIMITS).max_tokens == 5
    # No room at all: still one token (never 0, which SamplingParams rejects).
    assert sampling_params(sp(), LIMITS.max_model_len, LIMITS).max_tokens == 1


def test_explicit_max_tokens_is_kept_when_it_fits():
    assert sampling_params(sp(max_tokens=7), 10, LIMITS).max_tokens == 7
    assert sampling_params(sp(max_tokens=502), 10, LIMITS).max_tokens == 502  # exactly max_model_len


@pytest.mark.parametrize("max_tokens", [503, 100_000, 2**32 - 1])
def test_explicit_max_tokens_beyond_the_context_is_invalid(max_tokens):
    # As vLLM: refused, never silently clamped.
    with pytest.raises(ValidationError) as e:
        sampling_params(sp(max_tokens=max_tokens), 10, LIMITS)
    assert e.value.field == "sampling.max_tokens" and "max_model_len=512" in str(e.value)


def test_fields_are_carried_over():
    msg = sp(
        max_tokens=9,
        temperature=0.7,
        top_k=50,
        top_p=0.9,
        seed=2**64 - 1,
        stop=["END", "\n\n"],
        stop_token_ids=[2, 999],
        ignore_eos=True,
    )
    p = sampling_params(msg, 10, LIMITS)
    assert p.max_tokens == 9
    assert p.temperature == pytest.approx(0.7)
    assert p.top_k == 50
    assert p.top_p == pytest.approx(0.9)
    assert p.seed == 2**64 - 1
    assert p.stop == ("END", "\n\n")
    assert p.stop_token_ids == (2, 999)
    assert p.ignore_eos is True


def test_seed_zero_is_a_seed_not_unset():
    assert sampling_params(sp(seed=0), 10, LIMITS).seed == 0
    assert sampling_params(sp(), 10, LIMITS).seed is None


# ---- sampling: temperature -------------------------------------------------------------------------
@pytest.mark.parametrize("t", [0.0, 1e-6, 1.0, 100.0])
def test_temperature_in_range(t):
    assert sampling_params(sp(temperature=t), 10, LIMITS).temperature == pytest.approx(t)


@pytest.mark.parametrize("t", [-1e-3, -1.0, 100.5, math.nan, math.inf, -math.inf])
def test_temperature_out_of_range(t):
    with pytest.raises(ValidationError) as e:
        sampling_params(sp(temperature=t), 10, LIMITS)
    assert field_of(e) == "sampling.temperature"


# ---- sampling: top_k / top_p -----------------------------------------------------------------------
def test_top_k_below_vocab():
    assert sampling_params(sp(top_k=LIMITS.vocab_size - 1), 10, LIMITS).top_k == LIMITS.vocab_size - 1


@pytest.mark.parametrize("k", [LIMITS.vocab_size, LIMITS.vocab_size + 1, 2**32 - 1])
def test_top_k_at_or_above_vocab(k):
    with pytest.raises(ValidationError) as e:
        sampling_params(sp(top_k=k), 10, LIMITS)
    assert field_of(e) == "sampling.top_k"


@pytest.mark.parametrize("p", [1e-6, 0.5, 1.0])
def test_top_p_in_range(p):
    assert sampling_params(sp(top_p=p), 10, LIMITS).top_p == pytest.approx(p)


@pytest.mark.parametrize("p", [0.0, -0.5, 1.0001, 2.0, math.nan, math.inf])
def test_top_p_out_of_range(p):
    with pytest.raises(ValidationError) as e:
        sampling_params(sp(top_p=p), 10, LIMITS)
    # SamplingParams' own check, surfaced under "sampling" with the field in the message.
    assert field_of(e) == "sampling"
    assert "top_p" in str(e.value)


@pytest.mark.parametrize("k", [0, 5, 20])
def test_logprobs_in_range(k):
    assert sampling_params(sp(logprobs=k), 10, LIMITS).logprobs == k
    assert sampling_params(sp(), 10, LIMITS).logprobs is None  # unset = none


def test_logprobs_out_of_range():
    with pytest.raises(ValidationError) as e:
        sampling_params(sp(logprobs=21), 10, LIMITS)
    assert field_of(e) == "sampling" and "logprobs" in str(e.value)


# ---- sampling: stop strings and stop token ids --------------------------------------------------------
def test_stop_strings_at_the_limits():
    stops = ["s" * MAX_STOP_LEN] + [f"stop{i}" for i in range(MAX_STOP_STRINGS - 1)]
    assert len(sampling_params(sp(stop=stops), 10, LIMITS).stop) == MAX_STOP_STRINGS


@pytest.mark.parametrize(
    "stops",
    [
        [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)],  # too many
        ["ok", ""],  # an empty one would stop every request at once
        ["s" * (MAX_STOP_LEN + 1)],  # too long
    ],
    ids=["too-many", "empty", "too-long"],
)
def test_bad_stop_strings(stops):
    with pytest.raises(ValidationError) as e:
        sampling_params(sp(stop=stops), 10, LIMITS)
    assert field_of(e) == "sampling.stop"


def test_stop_token_ids_in_vocab():
    assert sampling_params(sp(stop_token_ids=[0, LIMITS.vocab_size - 1]), 10, LIMITS).stop_token_ids == (
        0,
        LIMITS.vocab_size - 1,
    )


@pytest.mark.parametrize("bad", [-1, LIMITS.vocab_size, 2**31 - 1])
def test_stop_token_ids_out_of_vocab(bad):
    with pytest.raises(ValidationError) as e:
        sampling_params(sp(stop_token_ids=[1, bad]), 10, LIMITS)
    assert field_of(e) == "sampling.stop_token_ids"
    assert str(bad) in str(e.value)


# ---- order of checks -------------------------------------------------------------------------------
def test_temperature_checked_before_top_k():
    with pytest.raises(ValidationError) as e:
        sampling_params(sp(temperature=-1, top_k=LIMITS.vocab_size), 10, LIMITS)
    assert field_of(e) == "sampling.temperature"
