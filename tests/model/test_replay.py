"""Failover replay: a request resumed from the tokens its client already has continues exactly.

The original runs to the end on one engine; a fresh engine is given the prompt plus the first k
streamed tokens (``resume_output_ids``) and must produce the same remaining tokens and text, with
the output count continuing from k. Seeded sampling replays through the (seed, output index) RNG,
and a stop string whose match straddles the cut is held back and completed as in the original.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from kvserve.workers.core.request import WorkerRequest
from kvserve.workers.core.sampling_params import SamplingParams
from kvserve.workers.engine.config import EngineConfig
from kvserve.workers.engine.engine import LLMEngine

PROMPT = list(range(100, 112))
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=7, ignore_eos=True)


@dataclass
class Run:
    tokens: list[int]
    deltas: list[str]  # one per token, as streamed
    counts: list[int]  # num_output_tokens reported with each token
    finish_reason: str | None

    @property
    def text(self) -> str:
        return "".join(self.deltas)


def _engine(model_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), block_size=4, num_gpu_blocks=128))


def _run(engine: LLMEngine, params: SamplingParams, resume: list[int] | None = None) -> Run:
    engine.add_request(WorkerRequest("r", PROMPT, params, resume_output_ids=resume or ()))
    run = Run([], [], [], None)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id != "r":
                continue
            run.tokens += out.new_token_ids
            run.deltas.append(out.text_delta)
            run.counts.append(out.num_output_tokens)
            run.finish_reason = out.finish_reason
        engine.check_integrity()
    assert engine.pool.stats().used == 0
    return run


def _stop_across(engine: LLMEngine, run: Run) -> tuple[int, str]:
    """A cut k and a stop string that starts in the text of the first k tokens and ends after it,
    occurring nowhere earlier (so the original stops exactly there)."""
    tok = engine.tokenizer
    assert tok is not None
    full = tok.decode(run.tokens)
    for k in range(2, len(run.tokens) - 4):
        before = len(tok.decode(run.tokens[:k]))
        for start in range(before - 1, 0, -1):
            stop = full[start : before + 2]
            if len(stop) >= 3 and "\ufffd" not in stop and full.find(stop) == start:
                return k, stop
    raise AssertionError("no usable stop string across any cut: change PROMPT")


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("k", [1, 7, 15])
def test_replay_continues_token_and_text_identical(tiny_llama_dir: Path, params: SamplingParams, k: int) -> None:
    engine = _engine(tiny_llama_dir)
    original = _run(engine, params)
    assert len(original.tokens) == params.max_tokens

    replay = _run(_engine(tiny_llama_dir), params, original.tokens[:k])
    assert original.tokens[:k] + replay.tokens == original.tokens
    assert replay.counts == original.counts[k:]  # the count continues from the streamed tokens
    assert "".join(original.deltas[:k]) + replay.text == original.text
    assert replay.finish_reason == original.finish_reason == "length"


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_replay_with_stop_string_held_back_across_the_cut(tiny_llama_dir: Path, params: SamplingParams) -> None:
    probe = _run(_engine(tiny_llama_dir), params)
    engine = _engine(tiny_llama_dir)
    k, stop = _stop_across(engine, probe)
    params = replace(params, stop=(stop,))
    original = _run(engine, params)
    assert original.finish_reason == "stop" and k < len(original.tokens) < params.max_tokens
    shown_at_k = "".join(original.deltas[:k])
    decoded_at_k = engine.tokenizer.decode(original.tokens[:k])
    assert len(shown_at_k) < len(decoded_at_k), "the cut must fall inside a held-back stop prefix"

    replay = _run(_engine(tiny_llama_dir), params, original.tokens[:k])
    assert original.tokens[:k] + replay.tokens == original.tokens
    assert shown_at_k + replay.text == original.text
    assert stop not in original.text and replay.finish_reason == "stop"


def test_replay_rng_does_not_depend_on_batch_or_history(tiny_llama_dir: Path) -> None:
    """Another seeded request in the batch, started at a different time, changes nothing."""
    original = _run(_engine(tiny_llama_dir), SEEDED)
    engine = _engine(tiny_llama_dir)
    engine.add_request(WorkerRequest("other", list(range(300, 305)), replace(SEEDED, seed=8)))
    engine.step()
    replay = _run(engine, SEEDED, original.tokens[:5])
    assert original.tokens[:5] + replay.tokens == original.tokens


def test_resume_rejects_what_cannot_continue(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir)
    original = _run(engine, GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request(WorkerRequest("a", PROMPT, GREEDY, resume_output_ids=original.tokens))
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request(WorkerRequest("b", PROMPT, GREEDY, resume_output_ids=[10**9]))
    stop_id = original.tokens[3]
    with pytest.raises(ValueError, match="finished"):
        engine.add_request(WorkerRequest(
            "c", PROMPT, replace(GREEDY, stop_token_ids=(stop_id,)), resume_output_ids=original.tokens[:6]
        ))
    assert not engine.requests and engine.pool.stats().used == 0
