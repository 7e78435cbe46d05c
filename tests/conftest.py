"""Shared fixtures: tiny random checkpoints and a cached HF transformers greedy oracle.

HF ``generate`` is the slow part of the model tests, so its continuations are computed once per
(checkpoint, prompt) for the whole session and sliced for shorter lengths (greedy decoding with no
EOS stop is prefix-stable: the first n tokens of a 24-token continuation are the 16-token one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from kvserve.workers.models.random_model import init_random

# One thread: the tiny model is overhead-bound, and on a 2-core box spinning OpenMP threads would
# fight the Ray workers that integration tests run beside the test process.
torch.set_num_threads(1)

# Longest continuation any test asks the oracle for; every request is computed to this length.
HF_MAX_NEW_TOKENS = 24

HFGreedy = Callable[[Path, Sequence[Sequence[int]], int], list[list[int]]]


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tiny_llama")
    init_random(d, arch="llama", size="tiny", seed=0)
    return d


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tiny_qwen2")
    init_random(d, arch="qwen2", size="tiny", seed=0)
    return d


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tiny_qwen3")
    init_random(d, arch="qwen3", size="tiny", seed=0)
    return d


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct (fp32 HF directory) from the model cache (``make model-cache``
    fills it); fetched here when missing, and the test skipped with the reason when that fails."""
    from kvserve.cluster.model_fetch import FetchError, fetch

    try:
        return fetch("smollm2-135m-instruct", "float32", quiet=True)
    except FetchError as e:
        pytest.skip(f"SmolLM2 not in the model cache and cannot be fetched: {e}")


@pytest.fixture(scope="session")
def hf_greedy() -> HFGreedy:
    """``hf_greedy(model_dir, prompts, max_new_tokens)`` -> HF transformers greedy continuations.

    fp32, ``do_sample=False``, ``eos_token_id=None`` so generation never stops early (the engine
    runs with ``ignore_eos=True``). Results are cached per (dir, prompt) for the session.

    NOTE: no ``min_new_tokens``: with an EOS id set it would mask the EOS logit, and the oracle
    would then differ from a plain argmax (which the engine does) whenever EOS is the argmax. The
    length assertion below catches an early stop instead.
    """
    transformers = pytest.importorskip("transformers")
    models: dict[Path, torch.nn.Module] = {}
    cache: dict[tuple[Path, tuple[int, ...]], list[int]] = {}

    def model_for(model_dir: Path) -> torch.nn.Module:
        if model_dir not in models:
            models[model_dir] = transformers.AutoModelForCausalLM.from_pretrained(
                str(model_dir), dtype=torch.float32
            ).eval()
        return models[model_dir]

    def run(model_dir: Path, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        if not 0 < max_new_tokens <= HF_MAX_NEW_TOKENS:
            raise ValueError(f"max_new_tokens must be in 1..{HF_MAX_NEW_TOKENS}, got {max_new_tokens}")
        model_dir = Path(model_dir).resolve()
        outs = []
        for prompt in prompts:
            key = (model_dir, tuple(prompt))
            if key not in cache:
                model = model_for(model_dir)
                with torch.no_grad():
                    ids = model.generate(
                        torch.tensor([list(prompt)]),
                        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                        max_new_tokens=HF_MAX_NEW_TOKENS,
                        do_sample=False,
                        eos_token_id=None,
                        pad_token_id=0,
                    )
                new = ids[0, len(prompt) :].tolist()
                assert len(new) == HF_MAX_NEW_TOKENS, f"HF stopped early: {len(new)} tokens"
                cache[key] = new
            outs.append(cache[key][:max_new_tokens])
        return outs

    return run
