"""Decode graphs on the Triton backend: the padded static buffers (full-width block tables, padding rows
with context 1 and slot -1) give the eager torch backend's tokens. On CPU the graphs' eager twin runs the
interpreted kernels; on a GPU machine the same test captures and replays real CUDA graphs."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.workers.core.sampling_params import SamplingParams
from kvserve.workers.engine.engine import LLM

PROMPTS = [[5, 17, 99, 1000, 2047, 3], list(range(100, 121)), list(range(300, 309))]


def _generate(model_dir: Path, kv_cache_dtype: str, graphs: bool) -> tuple[list[list[int]], int]:
    # block_size 4, a 16-token budget (chunked prefills beside decodes), 3 sequences: decode steps of 1-3
    # rows, padded to the buckets 2 and 4.
    llm = LLM(str(model_dir), block_size=4, num_gpu_blocks=48, max_num_batched_tokens=16, max_model_len=64,
              max_num_seqs=3, kv_cache_dtype=kv_cache_dtype, enforce_eager=True)  # fmt: skip
    if graphs:
        llm.engine.enable_decode_graphs((2, 4))
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), check_integrity=True)
    graph_set = llm.engine.runner.decode_graphs
    return [o.token_ids for o in outs], graph_set.replays if graph_set is not None else 0


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_triton_decode_graphs_match_eager_torch(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, kv_cache_dtype: str
) -> None:
    monkeypatch.setenv("KVSERVE_ATTENTION_BACKEND", "torch")
    expected, _ = _generate(tiny_llama_dir, kv_cache_dtype, graphs=False)
    monkeypatch.setenv("KVSERVE_ATTENTION_BACKEND", "triton")
    tokens, replays = _generate(tiny_llama_dir, kv_cache_dtype, graphs=True)
    assert tokens == expected
    assert replays > 0
