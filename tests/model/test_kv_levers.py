"""KV capacity levers: sliding-window block release and the contiguous-reservation baseline."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from kvserve.workers.core.request import WorkerRequest
from kvserve.workers.core.sampling_params import SamplingParams
from kvserve.workers.engine.engine import LLM

WINDOW = 8
N_NEW = 24


@pytest.fixture(scope="module")
def mistral_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama weights under a Mistral config with a small sliding window."""
    out = tmp_path_factory.mktemp("mistral-window")
    for f in tiny_llama_dir.iterdir():
        shutil.copy(f, out / f.name)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=WINDOW)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 32000, (n,), generator=g).tolist() for n in (5, 13, 30)]


def test_sliding_window_matches_hf_and_bounds_footprint(mistral_dir: Path, hf_greedy) -> None:
    prompts = _prompts()
    expected = hf_greedy(mistral_dir, prompts, N_NEW)
    llm = LLM(str(mistral_dir), block_size=4, num_gpu_blocks=64)
    engine = llm.engine
    params = SamplingParams(max_tokens=N_NEW, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(WorkerRequest(str(i), p, params))
    got: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    peak_live = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
        engine.check_integrity()
        peak_live = max([peak_live] + [len(r.live_blocks) for r in engine.scheduler.running])
    assert [got[str(i)] for i in range(len(prompts))] == expected
    # A window of 8 tokens spans at most 3 blocks of 4, plus the block being written.
    assert peak_live <= -(-WINDOW // 4) + 1
    assert engine.pool.stats().used == 0


def test_contiguous_allocator_admits_floor_pool_over_reservation(tiny_llama_dir: Path) -> None:
    block_size, max_model_len, pool = 16, 64, 18  # reservation = 4 blocks -> 4 requests fit
    llm = LLM(
        str(tiny_llama_dir), block_size=block_size, num_gpu_blocks=pool, max_model_len=max_model_len,
        allocator="contiguous", watermark=0.0,
    )  # fmt: skip
    engine = llm.engine
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[7 + i] * 10 for i in range(6)]
    for i, p in enumerate(prompts):
        engine.add_request(WorkerRequest(str(i), p, params))
    engine.step()
    assert len(engine.scheduler.running) == pool // (max_model_len // block_size)
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_integrity()
    paged = LLM(str(tiny_llama_dir), block_size=block_size, num_gpu_blocks=pool, max_model_len=max_model_len)
    contiguous = LLM(
        str(tiny_llama_dir), block_size=block_size, num_gpu_blocks=pool, max_model_len=max_model_len,
        allocator="contiguous", watermark=0.0,
    )  # fmt: skip
    assert [o.token_ids for o in contiguous.generate(prompts, params)] == [
        o.token_ids for o in paged.generate(prompts, params)
    ]


def test_contiguous_reserve_max_tokens(tiny_llama_dir: Path) -> None:
    llm = LLM(
        str(tiny_llama_dir), block_size=16, num_gpu_blocks=12, max_model_len=256,
        allocator="contiguous", reserve="max_tokens", watermark=0.0,
    )  # fmt: skip
    engine = llm.engine
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)  # 12 + 20 tokens -> 2 blocks
    for i in range(8):
        engine.add_request(WorkerRequest(str(i), [3 + i] * 12, params))
    engine.step()
    assert len(engine.scheduler.running) == 6
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.pool.stats().used == 0
