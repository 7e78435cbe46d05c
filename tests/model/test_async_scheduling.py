"""Overlapped scheduling (``async_scheduling``): step N+1 is scheduled while step N runs, its decodes read
step N's ids on the device, and the host learns them one step later. Tokens must equal the synchronous
engine's (and HF fp32's) exactly; a stop found one step late never streams the extra token, and every
block comes back."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.workers.core.request import WorkerRequest
from kvserve.workers.core.sampling_params import SamplingParams
from kvserve.workers.engine.engine import LLM, LLMEngine
from kvserve.workers.engine.model_runner import PENDING
from tests.model.test_decode_graphs import _guard_unowned_blocks
from tests.model.workload import BUCKETS, GREEDY, MIXED, PREFIX, N, rand_ids


@pytest.fixture(params=["llama", "qwen2"])
def model_dir(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(f"tiny_{request.param}_dir")


def _llm(model_dir: Path, overlap: bool, graphs: bool = True, **kwargs: object) -> LLM:
    llm = LLM(str(model_dir), device="cpu", async_scheduling=overlap, **kwargs)
    if graphs:
        llm.engine.enable_decode_graphs(BUCKETS)
        _guard_unowned_blocks(llm.engine)
    _guard_no_step_past_max_tokens(llm.engine)
    return llm


def _guard_no_step_past_max_tokens(engine: LLMEngine) -> None:
    """A request whose (possibly pending) last token is its max_tokens-th is never run again: its stop is certain."""
    launch = engine.runner.launch

    def guarded(out, feed=None):
        for req, n in out.scheduled:
            if n == 1 and req.num_output_tokens:
                assert req.num_output_tokens < req.sampling_params.max_tokens, req.request_id
        return launch(out, feed)

    engine.runner.launch = guarded  # type: ignore[method-assign]


def _generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    free = llm.engine.pool.num_free_blocks
    outs = llm.generate(prompts, params, check_integrity=True)
    engine = llm.engine
    assert not engine.has_unfinished_requests() and engine.pool.stats().used == 0
    assert engine.pool.num_free_blocks == free, "a block leaked"
    for o in outs:
        assert PENDING not in o.token_ids
    return [o.token_ids for o in outs]


def test_overlap_matches_hf_and_sync(model_dir: Path, hf_greedy) -> None:
    ref = hf_greedy(model_dir, MIXED, N)
    for graphs in (True, False):
        llm = _llm(model_dir, True, graphs, block_size=16, num_gpu_blocks=64, max_num_seqs=3)
        assert _generate(llm, MIXED) == ref
    assert _generate(_llm(model_dir, False, block_size=16, num_gpu_blocks=64, max_num_seqs=3), MIXED) == ref


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_overlap_with_preemption_matches_hf(model_dir: Path, hf_greedy, mode: str) -> None:
    swap = {"swap_space": 0.01} if mode == "swap" else {}
    llm = _llm(model_dir, True, block_size=4, num_gpu_blocks=16, preemption_mode=mode, **swap)
    assert _generate(llm, MIXED) == hf_greedy(model_dir, MIXED, N)
    assert llm.engine.scheduler.num_preemptions[mode] > 0


def test_overlap_with_prefix_hits_matches_hf(model_dir: Path, hf_greedy) -> None:
    prompts = [PREFIX + rand_ids(5, 8), PREFIX + rand_ids(11, 9), PREFIX]
    ref = hf_greedy(model_dir, prompts, N)
    llm = _llm(model_dir, True, block_size=16, num_gpu_blocks=64)
    assert _generate(llm, prompts[:1]) == ref[:1]
    second = llm.generate(prompts[1:], GREEDY, check_integrity=True)
    assert [o.token_ids for o in second] == ref[1:]
    assert [o.num_cached_tokens for o in second] == [32, 32]


def test_overlap_seeded_sampling_and_logprobs_equal_sync(tiny_llama_dir: Path) -> None:
    params = SamplingParams(max_tokens=N, temperature=0.9, top_p=0.9, seed=3, ignore_eos=True, logprobs=2)
    kw = {"block_size": 4, "num_gpu_blocks": 128, "max_num_seqs": 3}
    a = _llm(tiny_llama_dir, False, **kw).generate(MIXED, params)
    b = _llm(tiny_llama_dir, True, **kw).generate(MIXED, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.logprobs for o in a] == [o.logprobs for o in b]


@pytest.mark.parametrize("stop", ["eos", "stop_token", "max_tokens"])
def test_late_stop_never_streams_the_extra_token(tiny_llama_dir: Path, stop: str) -> None:
    """The stop of request 0 is found one step late (its next token is already computed): the stream ends
    at the stop exactly as the synchronous engine's does, while the other requests go on."""
    kw = {"block_size": 4, "num_gpu_blocks": 128}
    full = _generate(_llm(tiny_llama_dir, False, **kw), MIXED[:3])
    token = full[0][5]  # the stop: request 0's 6th token
    first = full[0].index(token) + 1
    params = [
        SamplingParams(max_tokens=first, temperature=0.0, ignore_eos=True)
        if stop == "max_tokens"
        else SamplingParams(max_tokens=N, temperature=0.0, stop_token_ids=[token], ignore_eos=stop != "stop_token")
        if stop == "stop_token"
        else SamplingParams(max_tokens=N, temperature=0.0),
        GREEDY,
        GREEDY,
    ]
    sync = _llm(tiny_llama_dir, False, **kw)
    overlap = _llm(tiny_llama_dir, True, **kw)
    if stop == "eos":
        for llm in (sync, overlap):
            llm.engine.eos_token_ids = frozenset({token})
    expected = _generate(sync, MIXED[:3], params)
    assert expected[0] == full[0][:first] and expected[1:] == full[1:]
    assert _generate(overlap, MIXED[:3], params) == expected


def test_abort_mid_run(tiny_llama_dir: Path) -> None:
    """An abort while the request's next token is in flight: nothing more is streamed for it, its blocks
    come back, the others finish token-exact."""
    kw = {"block_size": 4, "num_gpu_blocks": 128}
    full = _generate(_llm(tiny_llama_dir, False, **kw), MIXED[:3])
    engine = _llm(tiny_llama_dir, True, **kw).engine
    free = engine.pool.num_free_blocks
    for i, prompt in enumerate(MIXED[:3]):
        engine.add_request(WorkerRequest(f"r{i}", prompt, GREEDY))
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
    aborted = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
        if aborted is None and len(got["r0"]) == 4:
            aborted = engine.abort_request("r0")
            assert aborted is not None and aborted.num_output_tokens == 4
    assert got["r0"] == full[0][:4]
    assert [got["r1"], got["r2"]] == full[1:]
    assert engine.pool.num_free_blocks == free and engine.pool.stats().used == 0


def test_overlap_replay_and_migration_continue_exactly(tiny_llama_dir: Path) -> None:
    """A resumed request (replay) and one exported mid-run (the engine drains first) continue token-exact."""
    prompt = list(range(100, 112))
    kw = {"block_size": 4, "num_gpu_blocks": 128}
    tokens = _generate(_llm(tiny_llama_dir, False, **kw), [prompt])[0]
    engine = _llm(tiny_llama_dir, True, **kw).engine
    engine.add_request(WorkerRequest("r", prompt, GREEDY, resume_output_ids=tokens[:7]))
    rest: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            rest.extend(out.new_token_ids)
    assert tokens[:7] + rest == tokens

    src, dst = _llm(tiny_llama_dir, True, **kw).engine, _llm(tiny_llama_dir, True, **kw).engine
    src.add_request(WorkerRequest("m", prompt, GREEDY))
    got: list[int] = []
    while len(got) < 5:
        for out in src.step():
            got.extend(out.new_token_ids)
    state = src.export_request("m")
    assert state is not None and PENDING not in state.output_token_ids
    for out in src.step():  # the drain's outputs come with the next step
        got.extend(out.new_token_ids)
    assert state.output_token_ids == got
    assert dst.import_request(state) is True
    assert src.finish_export("m", migrated=True)
    assert src.pool.stats().used == 0
    while dst.has_unfinished_requests():
        for out in dst.step():
            got.extend(out.new_token_ids)
    assert got == tokens


def test_pending_decode_after_a_known_one(tiny_llama_dir: Path) -> None:
    """A more important request whose chunked prefill ends with one known token sits in the decode row
    before a request whose token is still pending: each row takes its own input."""
    kw = {"block_size": 4, "num_gpu_blocks": 64, "max_num_batched_tokens": 16}
    a, b = rand_ids(9, 21), rand_ids(16, 22)  # b: a 15-token chunk beside a's decode, then 1 token

    def run(overlap: bool) -> dict[str, list[int]]:
        engine = _llm(tiny_llama_dir, overlap, graphs=False, **kw).engine
        engine.add_request(WorkerRequest("a", a, GREEDY))
        got: dict[str, list[int]] = {"a": [], "b": []}
        while engine.has_unfinished_requests():
            for out in engine.step():
                got[out.request_id].extend(out.new_token_ids)
            if len(got["a"]) == 2 and not got["b"] and "b" not in engine.requests:
                engine.add_request(WorkerRequest("b", b, GREEDY, priority=1))
        assert engine.pool.stats().used == 0
        return got

    assert run(True) == run(False)


def test_overlap_refuses_tensor_parallel() -> None:
    """Tensor-parallel ranks get rank 0's host-staged ids, which a pending token is not part of."""
    from kvserve.workers.engine.config import EngineConfig

    with pytest.raises(ValueError, match="async_scheduling needs tensor_parallel_size 1"):
        EngineConfig(model="m", async_scheduling=True, tensor_parallel_size=2)
    assert EngineConfig(model="m", async_scheduling=True).async_scheduling
