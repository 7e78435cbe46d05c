"""``kvserve plan`` arithmetic: the KV formula exactly, weights, and agreement with the engine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.cluster.plan import PRESETS, Shape, kv_bytes_per_token, plan
from kvserve.workers.core.request import WorkerRequest


# int8 rows carry one fp32 scale each: 128 one-byte elements + 4 bytes.
@pytest.mark.parametrize("dtype,row_bytes", [("fp32", 512), ("fp16", 256), ("bf16", 256), ("fp8", 128), ("int8", 132)])
def test_kv_formula_exact(dtype: str, row_bytes: int) -> None:
    s = PRESETS["llama-3-8b"]  # 32 layers, 8 KV heads, head dim 128
    assert kv_bytes_per_token(s, dtype) == 2 * 32 * 8 * row_bytes
    row = plan(s, context=8192, users=32, kv_dtype=dtype, memory_bytes=80 * 2**30)
    assert row.kv_bytes_per_request == 2 * 32 * 8 * row_bytes * 8192
    assert row.kv_bytes_total == 32 * row.kv_bytes_per_request
    assert row.blocks_per_request == 8192 // 16


def test_weights_match_published_param_counts() -> None:
    # Llama 3 8B has 8,030,261,248 parameters (untied embeddings).
    assert PRESETS["llama-3-8b"].num_params == 8_030_261_248
    assert PRESETS["mistral-7b"].num_params == 7_241_732_096


def test_fit_and_max_users() -> None:
    s = PRESETS["llama-3-8b"]
    weights = s.num_params * 2
    per_request = 2 * 32 * 8 * 128 * 2 * 4096
    row = plan(s, context=4096, users=10, kv_dtype="fp16", memory_bytes=weights + 10 * per_request)
    assert row.fits and row.max_users == 10
    row = plan(s, context=4096, users=11, kv_dtype="fp16", memory_bytes=weights + 10 * per_request)
    assert not row.fits and row.max_users == 10
    fp8 = plan(s, context=4096, users=1, kv_dtype="fp8", memory_bytes=weights + 10 * per_request)
    assert fp8.max_users == 20 and fp8.total_blocks == 2 * row.total_blocks


def test_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="unknown KV dtype"):
        plan(PRESETS["llama-3-8b"], 1024, 1, "fp4", 2**30)
    with pytest.raises(ValueError):
        plan(PRESETS["llama-3-8b"], 0, 1, "fp16", 2**30)


@pytest.mark.parametrize("plan_dtype,engine_dtype", [("fp32", "auto"), ("fp8", "fp8"), ("int8", "int8")])
def test_plan_matches_engine_admission(tiny_llama_dir: Path, plan_dtype: str, engine_dtype: str) -> None:
    """Plan's max users at a context == what a contiguous-reservation engine admits in the same memory."""
    from kvserve.workers.core.sampling_params import SamplingParams
    from kvserve.workers.engine.engine import LLM

    shape = Shape.from_model_dir(tiny_llama_dir)
    context, kv_memory = 256, 3 * 2**20
    row = plan(shape, context, 1, plan_dtype, kv_memory + shape.num_params * 4)
    llm = LLM(
        str(tiny_llama_dir), block_size=16, kv_cache_memory=kv_memory, max_model_len=context,
        allocator="contiguous", watermark=0.0, kv_cache_dtype=engine_dtype,
    )  # fmt: skip
    engine = llm.engine
    assert engine.pool.num_blocks == row.total_blocks
    for i in range(row.max_users + 3):
        engine.add_request(WorkerRequest(str(i), [11 + i] * 8, SamplingParams(max_tokens=2, temperature=0.0)))
    engine.step()
    assert len(engine.scheduler.running) == row.max_users
    while engine.has_unfinished_requests():
        engine.step()


def test_cli_json_on_checkpoint(tiny_llama_dir: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvserve.cluster.cli", "plan", "--model", str(tiny_llama_dir), "--context", "1024",
         "--users", "1,8", "--kv-cache-dtype", "fp32,fp8", "--gpu-memory", "1GiB", "--json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    data = json.loads(out.stdout)
    assert len(data["rows"]) == 4
    fp32 = next(r for r in data["rows"] if r["kv_dtype"] == "fp32")
    assert fp32["kv_bytes_per_token"] == 2 * 4 * 2 * 32 * 4
