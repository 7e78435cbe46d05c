"""Bad input fails fast with ValueError, takes no block, and leaves the engine serving; finish
reasons, abort and seeded sampling through the engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.workers.core.request import WorkerRequest
from kvserve.workers.core.sampling_params import SamplingParams
from kvserve.workers.engine.engine import LLM, LLMEngine

N = 24
GREEDY = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
PROMPT = [11, 2222, 333, 4444, 55, 6666, 777, 8888, 99, 1, 12, 13, 14, 15, 16, 17, 18, 19]  # 18 tokens


@pytest.fixture
def llm(tiny_llama_dir: Path) -> LLM:
    # 6 blocks of 16 = 96 tokens, max_model_len 80: small limits to bump into.
    return LLM(str(tiny_llama_dir), device="cpu", block_size=16, num_gpu_blocks=6, max_model_len=80)


def _snapshot(engine: LLMEngine) -> tuple:
    s = engine.scheduler
    return (
        engine.pool.stats(),
        list(engine.pool.ref_cnt),
        engine.pool.event_seq,
        sorted(engine.requests),
        [len(q) for q in (s.waiting, s.running, s.swapped)],
    )


def _assert_serves(llm: LLM, ref: list[int]) -> None:
    out = llm.generate([PROMPT], GREEDY, check_integrity=True)[0]
    assert out.token_ids == ref and out.finish_reason == "length"
    assert llm.engine.pool.stats().used == 0 and not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ([1] * 81, GREEDY, "max_model_len"),
        ([5, 32000, 7], GREEDY, "vocabulary"),
        ([5, -1], GREEDY, "vocabulary"),
        ([5, 7.0], GREEDY, "integers"),
        ([5, True], GREEDY, "booleans"),
        ([], GREEDY, "empty"),
        # The boundary: a prompt of exactly max_model_len tokens is accepted (match None).
        ([1] * 80, SamplingParams(max_tokens=1, temperature=0.0), None),
    ],
    ids=["too-long", "id-too-big", "id-negative", "id-float", "id-bool", "empty", "max-len-prompt-ok"],
)
def test_bad_prompt_raises_before_allocating(llm: LLM, hf_greedy, tiny_llama_dir: Path, prompt, params, match) -> None:
    engine = llm.engine
    before = _snapshot(engine)
    if match is None:
        engine.add_request(WorkerRequest("edge", prompt, params))  # the boundary itself is accepted
        engine.abort_request("edge")
    else:
        with pytest.raises(ValueError, match=match):
            engine.add_request(WorkerRequest("bad", prompt, params))
        assert "bad" not in engine.requests
    assert _snapshot(engine) == before
    engine.check_integrity()
    _assert_serves(llm, hf_greedy(tiny_llama_dir, [PROMPT], N)[0])


def test_request_that_can_never_fit_the_pool(tiny_llama_dir: Path, hf_greedy) -> None:
    # 4 blocks of 16 = 64 tokens, max_model_len 200.
    llm = LLM(str(tiny_llama_dir), device="cpu", block_size=16, num_gpu_blocks=4, max_model_len=200)
    engine = llm.engine
    before = _snapshot(engine)
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request(WorkerRequest("long-prompt", [3] * 65, SamplingParams(max_tokens=1)))
    with pytest.raises(ValueError, match="prompt \\+ max_tokens"):
        engine.add_request(WorkerRequest("long-output", [3] * 10, SamplingParams(max_tokens=55)))
    assert _snapshot(engine) == before
    engine.add_request(WorkerRequest("fits", [3] * 10, SamplingParams(max_tokens=54, temperature=0.0)))  # 64 tokens
    engine.abort_request("fits")
    _assert_serves(llm, hf_greedy(tiny_llama_dir, [PROMPT], N)[0])


def test_max_tokens_must_be_positive() -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_tokens"):
            SamplingParams(max_tokens=bad)


def test_duplicate_request_id(llm: LLM, hf_greedy, tiny_llama_dir: Path) -> None:
    engine = llm.engine
    first = engine.add_request(WorkerRequest("dup", PROMPT, GREEDY))
    before = _snapshot(engine)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(WorkerRequest("dup", [1, 2, 3], GREEDY))
    assert _snapshot(engine) == before and engine.requests["dup"] is first
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
        engine.check_integrity()
    assert tokens == hf_greedy(tiny_llama_dir, [PROMPT], N)[0]
    engine.add_request(WorkerRequest("dup", PROMPT, SamplingParams(max_tokens=1)))  # the id is free once finished
    engine.abort_request("dup")


def test_batch_with_one_bad_prompt_runs_nothing(llm: LLM, hf_greedy, tiny_llama_dir: Path) -> None:
    engine = llm.engine
    before = _snapshot(engine)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([PROMPT, [1, 2, 99999]], GREEDY)
    assert _snapshot(engine) == before
    _assert_serves(llm, hf_greedy(tiny_llama_dir, [PROMPT], N)[0])


def test_text_prompt_without_tokenizer(tiny_llama_dir: Path, tmp_path: Path, hf_greedy) -> None:
    d = tmp_path / "no-tokenizer"
    d.mkdir()
    for f in tiny_llama_dir.iterdir():
        if f.name != "tokenizer.json":
            (d / f.name).symlink_to(f)
    llm = LLM(str(d), device="cpu", block_size=16, num_gpu_blocks=6)
    assert llm.engine.tokenizer is None
    with pytest.raises(ValueError, match="tokenizer"):
        llm.engine.add_request(WorkerRequest("text", "hello world", GREEDY))
    assert llm.engine.requests == {} and llm.engine.pool.stats().used == 0
    out = llm.generate([PROMPT], GREEDY, check_integrity=True)[0]  # token ids still work
    assert out.token_ids == hf_greedy(tiny_llama_dir, [PROMPT], N)[0]
    assert out.text == ""


def test_text_prompt_with_tokenizer(llm: LLM) -> None:
    out = llm.generate(["Hello, world"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert out.prompt_token_ids[0] == 1  # <s> from the tokenizer's template
    assert len(out.token_ids) == 4


def test_abort_mid_generation_frees_blocks(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request(WorkerRequest("a", PROMPT, GREEDY))
    engine.add_request(WorkerRequest("b", [7] * 20, GREEDY))
    for _ in range(3):
        engine.step()
        engine.check_integrity()
    assert engine.pool.stats().used == 4  # 2 blocks each (18 + 3 and 20 + 3 tokens)
    out = engine.abort_request("a")
    assert out is not None and out.finish_reason == "abort" and out.num_output_tokens == 3
    assert engine.pool.stats().used == 2
    engine.check_integrity()
    assert engine.abort_request("a") is None  # already gone
    assert engine.abort_request("never-added") is None
    engine.abort_request("b")
    assert engine.pool.stats().used == 0 and not engine.has_unfinished_requests()
    engine.check_integrity()
    assert engine.step() == []


def test_abort_swapped_request_frees_host_blocks(tiny_llama_dir: Path, hf_greedy) -> None:
    llm = LLM(str(tiny_llama_dir), device="cpu", block_size=16, num_gpu_blocks=8, swap_space=0.001)
    engine = llm.engine
    assert engine.swap_pool is not None
    engine.add_request(WorkerRequest("a", [3] * 20, GREEDY))
    engine.add_request(WorkerRequest("b", PROMPT, GREEDY))
    tokens: list[int] = []
    for _ in range(2):
        tokens += [t for o in engine.step() if o.request_id == "b" for t in o.new_token_ids]
    assert engine.preempt_request("a", mode="swap")  # a router command: KV copied to the host
    assert engine.swap_pool.stats().used == 2 and engine.pool.stats().used == 2
    engine.check_integrity()
    out = engine.abort_request("a")
    assert out is not None and out.finish_reason == "abort"
    assert engine.swap_pool.stats().used == 0 and engine.pool.stats().used == 2
    engine.check_integrity()
    while engine.has_unfinished_requests():
        tokens += [t for o in engine.step() for t in o.new_token_ids]
        engine.check_integrity()
    assert tokens == hf_greedy(tiny_llama_dir, [PROMPT], N)[0]
    assert engine.pool.stats().used == 0


def test_abort_while_waiting(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request(WorkerRequest("w", PROMPT, GREEDY))
    out = engine.abort_request("w")
    assert out is not None and out.finish_reason == "abort" and out.num_output_tokens == 0
    assert not engine.has_unfinished_requests() and engine.pool.stats().used == 0
    engine.check_integrity()


def test_finish_reasons(llm: LLM, hf_greedy, tiny_llama_dir: Path) -> None:
    ref = hf_greedy(tiny_llama_dir, [PROMPT], N)[0]
    k = next(i for i in range(3, N) if ref[i] not in ref[:i])  # first occurrence, a few tokens in
    stop = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, stop_token_ids=[ref[k]])
    short = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    by_stop, by_length = llm.generate([PROMPT, PROMPT], [stop, short], check_integrity=True)
    assert by_stop.token_ids == ref[: k + 1] and by_stop.finish_reason == "stop"  # the stop id is kept
    assert by_length.token_ids == ref[:5] and by_length.finish_reason == "length"
    assert llm.engine.pool.stats().used == 0


def test_max_model_len_finishes_with_length(llm: LLM) -> None:
    out = llm.generate([[9] * 70], GREEDY, check_integrity=True)[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"  # 70 + 10 = max_model_len


def test_seeded_sampling_is_reproducible_across_batches(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), device="cpu", block_size=16, num_gpu_blocks=64)
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    other = SamplingParams(max_tokens=16, temperature=0.8, top_k=50, seed=7, ignore_eos=True)
    unseeded = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    alone = llm.generate([PROMPT], seeded, check_integrity=True)[0].token_ids
    batch = llm.generate([[5] * 30, PROMPT, [6] * 3], [other, seeded, unseeded], check_integrity=True)
    assert batch[1].token_ids == alone
    # A tiny pool: the seeded request is preempted and recomputed, and still draws the same tokens.
    small = LLM(str(tiny_llama_dir), device="cpu", block_size=4, num_gpu_blocks=12)
    crowded = small.generate([[5] * 30, PROMPT, [6] * 3], [other, seeded, unseeded], check_integrity=True)
    assert any(o.num_preemptions for o in crowded)
    assert crowded[1].token_ids == alone
    # The seed matters: another seed gives another sequence.
    reseeded = SamplingParams(max_tokens=16, temperature=1.0, seed=4321, ignore_eos=True)
    assert llm.generate([PROMPT], reseeded)[0].token_ids != alone
