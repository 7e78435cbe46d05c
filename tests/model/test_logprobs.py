"""SamplingParams.logprobs: the sampled token's log-probability and the top k, equal to HF's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve.workers.core.sampling_params import SamplingParams
from kvserve.workers.engine.engine import LLM


def test_logprobs_match_hf_and_leave_tokens_alone(tiny_llama_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    prompts = [list(range(5, 25)), [7, 300, 9]]
    llm = LLM(str(tiny_llama_dir), block_size=4, num_gpu_blocks=64)
    plain = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    with_lp = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    for a, b in zip(plain, with_lp, strict=True):
        assert a.logprobs is None and b.token_ids == a.token_ids
        assert b.logprobs is not None and len(b.logprobs) == len(b.token_ids)
        with torch.no_grad():
            logits = hf(torch.tensor([b.prompt_token_ids + b.token_ids[:-1]])).logits[0].float()
        expected = torch.log_softmax(logits, -1)[len(b.prompt_token_ids) - 1 :]
        for i, (token, entry) in enumerate(zip(b.token_ids, b.logprobs, strict=True)):
            top = expected[i].topk(3)
            assert set(entry) == {token, *top.indices.tolist()}  # greedy: the sampled token is in the top 3
            for tid, lp in entry.items():
                assert lp == pytest.approx(float(expected[i, tid]), abs=1e-4)


def test_sampled_token_is_reported_when_outside_the_top_k(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), block_size=4, num_gpu_blocks=64)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8, temperature=5.0, seed=1, logprobs=0, ignore_eos=True))
    assert out[0].logprobs is not None
    assert [list(e) for e in out[0].logprobs] == [[t] for t in out[0].token_ids]
    assert all(lp <= 0 for e in out[0].logprobs for lp in e.values())


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True])
def test_bad_logprobs_rejected(bad: object) -> None:
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=bad)  # type: ignore[arg-type]
