"""The engine end to end on the Triton backend (interpreted on CPU) gives the torch backend's tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.workers.core.sampling_params import SamplingParams
from kvserve.workers.engine.engine import LLM

PROMPTS = [[5, 17, 99, 1000, 2047, 3], list(range(100, 121))]  # a short and a 21-token prompt


def _generate(model_dir: Path, kv_cache_dtype: str) -> list[list[int]]:
    # block_size 4 and a small budget: several blocks per sequence and a chunked prefill.
    llm = LLM(str(model_dir), block_size=4, num_gpu_blocks=32, max_num_batched_tokens=16, kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, check_integrity=True)
    return [o.token_ids for o in outs]


# Quantized caches too: both backends quantize with the same formula, so the tokens match as well.
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp16", "int8", "fp8"])
def test_engine_triton_backend_matches_torch(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, kv_cache_dtype: str
) -> None:
    monkeypatch.setenv("KVSERVE_ATTENTION_BACKEND", "torch")
    expected = _generate(tiny_llama_dir, kv_cache_dtype)
    monkeypatch.setenv("KVSERVE_ATTENTION_BACKEND", "triton")
    from kvserve.kernels import triton_backend

    calls: dict[str, int] = {}
    names = ("rope_store_kv", "decode_attention", "prefill_attention", "rms_norm", "fused_add_rms_norm", "silu_and_mul")
    for name in names:
        fn = getattr(triton_backend, name)

        def counted(*args, _fn=fn, _name=name, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _fn(*args, **kwargs)

        monkeypatch.setattr(triton_backend, name, counted)
    assert _generate(tiny_llama_dir, kv_cache_dtype) == expected
    assert min(calls.values()) > 0 and len(calls) == len(names), f"triton kernels not all used: {calls}"


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_engine_triton_backend_matches_torch_on_qwen(
    arch: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """q/k/v biases (Qwen2) and per-head q/k norms over qkv slices (Qwen3) through the fused Triton ops."""
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    monkeypatch.setenv("KVSERVE_ATTENTION_BACKEND", "torch")
    expected = _generate(model_dir, "auto")
    monkeypatch.setenv("KVSERVE_ATTENTION_BACKEND", "triton")
    assert _generate(model_dir, "auto") == expected
