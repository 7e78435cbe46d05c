"""Decode graphs under tensor parallelism (kvserve/workers/parallel/runner.py): every rank captures the same
buckets, rank 0 broadcasts each graph step's staged static-buffer rows and every rank replays that bucket.
On CPU the graphs' eager twin runs the same protocol over a real gloo group: tokens with graphs on equal
HF's (greedy, under swap preemption) and TP=1's with graphs on (seeded sampling and logprobs, which add a
logits gather after the replay)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.workers.core.sampling_params import SamplingParams
from kvserve.workers.engine.engine import LLM
from tests.model.workload import BUCKETS, GREEDY, MIXED, N


def _graph_llm(model_dir: Path, tp: int, **kwargs: object) -> LLM:
    llm = LLM(str(model_dir), device="cpu", tensor_parallel_size=tp, **kwargs)
    llm.engine.enable_decode_graphs(BUCKETS)
    return llm


def _close(llm: LLM) -> None:
    llm.engine.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tp2_graph_decode_with_swap_matches_hf(arch: str, request: pytest.FixtureRequest, hf_greedy) -> None:
    """Batches of 1..6 decodes: buckets 1, 2, 4 replay (padded), 5 and 6 run eagerly; swaps in between."""
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    llm = _graph_llm(model_dir, 2, block_size=4, num_gpu_blocks=16, preemption_mode="swap", swap_space=0.01)
    try:
        outs = llm.generate(MIXED, GREEDY, check_integrity=True)
        assert llm.engine.scheduler.num_preemptions["swap"] > 0
        assert llm.engine.runner.decode_graphs.replays > 0
        assert llm.engine.followers_alive()
    finally:
        _close(llm)
    assert [o.token_ids for o in outs] == hf_greedy(model_dir, MIXED, N)


def test_tp2_graph_decode_sampling_equals_tp1_graphs(tiny_llama_dir: Path) -> None:
    """Seeded sampling and logprobs: rank 0 computes full logits after the replay (the ranks add one gather)."""
    params = SamplingParams(max_tokens=N, temperature=0.9, top_p=0.9, seed=3, ignore_eos=True, logprobs=2)
    mixed = [params if i % 2 else GREEDY for i in range(len(MIXED))]  # greedy and sampled rows in one batch
    one = _graph_llm(tiny_llama_dir, 1, block_size=4, num_gpu_blocks=128, max_num_seqs=3)
    want = one.generate(MIXED, mixed)
    want_greedy = one.generate(MIXED[:3], GREEDY)
    two = _graph_llm(tiny_llama_dir, 2, block_size=4, num_gpu_blocks=128, max_num_seqs=3)
    try:
        got = two.generate(MIXED, mixed)
        greedy_only = two.generate(MIXED[:3], GREEDY)  # steps where the graph's greedy head alone decides
        assert two.engine.runner.decode_graphs.replays > 0
    finally:
        _close(two)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.token_ids for o in greedy_only] == [o.token_ids for o in want_greedy]
    worst = max(abs(a[t] - b[t]) for x, y in zip(want, got, strict=True) if x.logprobs for a, b in
                zip(x.logprobs, y.logprobs or [], strict=True) for t in a)  # fmt: skip
    assert worst <= 1e-4, worst
