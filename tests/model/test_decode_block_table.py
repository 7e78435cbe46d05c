"""The decode graphs' persistent block table (``input_buffers.DecodeBuffers``: rows kept per request table, only
changed entries uploaded) changes no token: graphs on (the CPU eager twin, which reads the table the scatter and
gather laid out) == graphs off == HF greedy, with more requests over time than table rows (rows reclaimed from
finished requests and recycled), preemption by recompute and by swap (tables dropped and replaced), prefix hits
and overlapped scheduling."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.workers.engine.engine import LLM
from kvserve.workers.engine.table_mirror import TableRows
from tests.model.test_decode_graphs import _guard_unowned_blocks
from tests.model.workload import BUCKETS, GREEDY, MIXED, PREFIX, PREFIX_A, PREFIX_B, N, rand_ids

FIRST = [*MIXED, PREFIX, *(rand_ids(n, 300 + i) for i, n in enumerate((9, 21, 33)))]  # 10 requests, 4 rows
SECOND = [PREFIX_A, PREFIX_B]  # PREFIX's blocks are cached by then

CASES = {
    "plenty": {"block_size": 16, "num_gpu_blocks": 64, "max_num_seqs": 4},
    "recompute": {"block_size": 4, "num_gpu_blocks": 20, "preemption_mode": "recompute"},
    "swap": {"block_size": 4, "num_gpu_blocks": 20, "preemption_mode": "swap", "swap_space": 0.01},
}


def _run(model_dir: Path, graphs: bool, overlap: bool, kwargs: dict) -> tuple[LLM, list[list[int]]]:
    llm = LLM(str(model_dir), device="cpu", async_scheduling=overlap, **kwargs)
    if graphs:
        llm.engine.enable_decode_graphs(BUCKETS)
        _guard_unowned_blocks(llm.engine)
    tokens = []
    for prompts in (FIRST, SECOND):
        outs = llm.generate(prompts, GREEDY, check_integrity=True)
        assert not llm.engine.has_unfinished_requests() and llm.engine.pool.stats().used == 0
        tokens += [o.token_ids for o in outs]
        if prompts is SECOND and kwargs["num_gpu_blocks"] == 64:
            assert all(o.num_cached_tokens >= 32 for o in outs)  # both hit PREFIX's blocks
    return llm, tokens


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_graph_tokens_with_recycled_rows_equal_eager_and_hf(
    tiny_llama_dir: Path, hf_greedy, monkeypatch: pytest.MonkeyPatch, case: str, overlap: bool
) -> None:
    reclaimed = []  # rows taken from another table (a finished, preempted or replaced one)
    reclaim = TableRows._reclaim

    def counting(self: TableRows) -> int:
        r = reclaim(self)
        reclaimed.append(r)
        return r

    monkeypatch.setattr(TableRows, "_reclaim", counting)
    kwargs = CASES[case]
    graph_llm, graph = _run(tiny_llama_dir, True, overlap, kwargs)
    _, eager = _run(tiny_llama_dir, False, overlap, kwargs)
    assert graph == eager == hf_greedy(tiny_llama_dir, FIRST + SECOND, N)
    graphs = graph_llm.engine.runner.decode_graphs
    assert graphs is not None and graphs.replays > 0
    assert len(reclaimed) > 2 * graphs.buffers.table.rows  # every row recycled, some many times
    if case != "plenty":
        assert graph_llm.engine.scheduler.num_preemptions[case] > 0
