"""A real model: SmolLM2-135M-Instruct (``kvserve model fetch``), checked against HF transformers.

On a trained model the logit gaps are large, so greedy tokens must match exactly: 16 chat prompts
sharing a system prompt x 64 new tokens, under recompute preemption and prefix-cache hits; the
GGUF file served directly must give the HF directory's tokens; and the model must answer.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve.workers.core.sampling_params import SamplingParams
from kvserve.workers.engine.engine import LLM
from kvserve.workers.models.gguf_checkpoint import find_gguf
from kvserve.workers.models.loader import load_model
from kvserve.workers.text.tokenizer import load_tokenizer

NEW_TOKENS = 64
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "How many legs does a spider have?",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
    "Explain photosynthesis in one sentence.",
    "Who wrote Romeo and Juliet?",
    "Give me a synonym for happy.",
    "What is the boiling point of water in Celsius?",
    "Translate 'good morning' into Spanish.",
    "List two benefits of exercise.",
    "What planet is known as the Red Planet?",
    "Describe a cat in five words.",
    "Why is the sky blue?",
    "What does CPU stand for?",
    "Suggest a name for a pet goldfish.",
]


def chatml(question: str) -> str:
    """SmolLM2's chat template (ChatML) rendered by hand, generation prompt included."""
    return (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.fixture(scope="module")
def prompts(smollm2_dir: Path) -> list[list[int]]:
    tok = load_tokenizer(smollm2_dir)
    assert tok is not None
    return [tok.encode(chatml(q)) for q in QUESTIONS]


@pytest.fixture(scope="module")
def hf_reference(smollm2_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    """HF transformers greedy continuations (fp32, no EOS stop) of all prompts in one left-padded batch.

    NOTE: one batch, not one prompt at a time: batch-1 decoding reads all 540 MB of fp32 weights per
    token (~110 s of CPU for 16 x 64 tokens against ~17 s batched). Measured when this test was
    written: the batched continuations equal the one-at-a-time ones on all 16 x 64 tokens.
    """
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    longest = max(map(len, prompts))
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    new = out[:, longest:].tolist()
    assert all(len(row) == NEW_TOKENS for row in new), "HF stopped early"
    return new


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def test_hf_tokenizer_agrees(smollm2_dir: Path, prompts: list[list[int]]) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(smollm2_dir))
    assert [hf(chatml(q)).input_ids for q in QUESTIONS] == prompts


def test_greedy_matches_hf_with_preemption_and_prefix_hits(
    smollm2_dir: Path, prompts: list[list[int]], hf_reference: list[list[int]]
) -> None:
    # 32 blocks x 16 tokens = 512 token slots for 15 requests of ~45 + 64 tokens: the batch must
    # preempt. The first request runs alone first, so the shared system prompt's blocks are cached.
    llm = LLM(str(smollm2_dir), device="cpu", block_size=16, num_gpu_blocks=32)
    first = llm.generate(prompts[:1], GREEDY, check_integrity=True)
    rest = llm.generate(prompts[1:], GREEDY, check_integrity=True)
    outs = first + rest
    mismatched = [i for i, (o, want) in enumerate(zip(outs, hf_reference, strict=True)) if o.token_ids != want]
    assert not mismatched, f"{len(mismatched)}/16 prompts differ from HF: {mismatched}"
    assert first[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens >= 16 for o in rest)  # the system prompt's first block at least
    assert llm.engine.scheduler.num_preemptions["recompute"] > 0
    assert llm.engine.pool.stats().used == 0


def test_chat_answer_and_end_of_turn(smollm2_dir: Path) -> None:
    llm = LLM(str(smollm2_dir), device="cpu", num_gpu_blocks=64)
    tok = llm.engine.tokenizer
    im_end = tok._tok.token_to_id("<|im_end|>")
    assert im_end in llm.engine.eos_token_ids and tok._tok.token_to_id("<|endoftext|>") in llm.engine.eos_token_ids
    out = llm.generate([chatml("What is the capital of France?")], SamplingParams(max_tokens=48, temperature=0.0))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop" and out.token_ids[-1] == im_end  # the end of turn stops it
    assert "<|im_end|>" not in out.text


def test_gguf_direct_equals_hf_dir(smollm2_dir: Path, prompts: list[list[int]], hf_reference) -> None:
    gguf = find_gguf(smollm2_dir.parent / "smollm2-135m-instruct.gguf")
    assert gguf is not None
    # Same tokenizer: ids of every prompt, and of text with digits, unicode and special tokens.
    tok_dir, tok_gguf = load_tokenizer(smollm2_dir), load_tokenizer(gguf)
    assert tok_dir is not None and tok_gguf is not None
    texts = [chatml(q) for q in QUESTIONS] + ["x=3.14159 naïve café 日本語 🙂\n\n  def f(): return 42"]
    assert [tok_gguf.encode(t) for t in texts] == [tok_dir.encode(t) for t in texts]
    assert tok_gguf.eos_token_ids == tok_dir.eos_token_ids
    # The engine serving the GGUF holds the HF directory's weights, bit for bit (fp32 both ways).
    llm = LLM(str(gguf), device="cpu", num_gpu_blocks=64)
    served = {n: t.to_dense() if t.is_mkldnn else t for n, t in llm.engine.model.state_dict().items()}
    from_dir = load_model(smollm2_dir, torch.float32).state_dict()
    assert served.keys() == from_dir.keys()
    for name, tensor in from_dir.items():
        assert torch.equal(served[name], tensor), name
    del from_dir
    # And gives its tokens.
    outs = llm.generate(prompts[:4], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [ref[:32] for ref in hf_reference[:4]]
