"""Where both exact greedy LM heads apply (the bf16 screen with AVX512-BF16, and the C++ packed head), the
model times them and keeps each where it won; tokens equal the fp32 argmax whichever head a batch takes."""

from __future__ import annotations

import pytest
import torch

from kvserve.workers.engine.engine import LLM
from kvserve.workers.host.path_choice import forget_choices
from kvserve.workers.models import model as model_module


@pytest.fixture(autouse=True)
def _measure_afresh():
    """Each test rigs the timing: a head choice remembered from an earlier engine must not answer for it."""
    forget_choices()
    yield
    forget_choices()


def _model(llm: LLM):
    return llm.engine.runner.model


def test_measured_head_choice_is_exact_for_every_batch(tiny_llama_dir, monkeypatch) -> None:
    # The C++ head wins at 8 rows, the screen at 64: a batch takes the head timed nearest its size.
    def rigged(candidates, repeats=3):
        rows = next(iter(candidates.values())).__defaults__[0].shape[0]
        return ("kvserve" if rows == 8 else "screen"), {"kvserve": 1.0, "screen": 1.0}

    monkeypatch.setattr(model_module, "fastest", rigged)
    model = _model(LLM(str(tiny_llama_dir), num_gpu_blocks=64))
    if model._screen is None and model._lm_head_cpu is None:
        pytest.skip("neither the bf16 screen (needs AVX512-BF16) nor the C++ head applies on this machine")
    if model._screen is not None:
        assert model._screen_wins == {8: False, 64: True} and model._lm_head_cpu is not None
        assert not model._screen_pays(4) and model._screen_pays(100)
    for rows in (1, 4, 30, 100):
        hidden = torch.randn(rows, model.config.hidden_size, generator=torch.Generator().manual_seed(rows))
        expected = model.compute_logits(hidden).argmax(-1).tolist()
        assert model.greedy_tokens(hidden) == expected


def test_a_head_that_never_wins_is_dropped(tiny_llama_dir, monkeypatch) -> None:
    monkeypatch.setattr(model_module, "fastest", lambda c, repeats=3: ("kvserve", {"kvserve": 1.0, "screen": 2.0}))
    model = _model(LLM(str(tiny_llama_dir), num_gpu_blocks=64))
    assert model._screen is None  # the C++ head won everywhere: no bf16 copy kept
