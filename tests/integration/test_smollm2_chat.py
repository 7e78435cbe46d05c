"""Chat with the real SmolLM2-135M-Instruct (fp32 HF directory from ``kvserve model fetch``): its chat
template renders as transformers renders it, and the capital-of-France question is answered with
Paris over the OpenAI HTTP API, stopping at the end-of-turn token.

Skipped when the model is not in the cache (``$KVSERVE_MODEL_CACHE`` or ``~/.cache/kvserve/models``,
as ``kvserve/cluster/model_fetch.py`` keeps it).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvserve.workers.text.chat_template import ChatMessage, ChatTemplate
from kvserve.workers.text.tokenizer import Tokenizer

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")

QUESTION = "What is the capital of France?"


def _model_dir() -> Path:
    root = Path(os.environ.get("KVSERVE_MODEL_CACHE") or Path.home() / ".cache" / "kvserve" / "models")
    return root / "smollm2-135m-instruct-float32"


@pytest.fixture(scope="module")
def smollm2() -> Path:
    d = _model_dir()
    if not (d / "config.json").is_file() or not (d / "tokenizer_config.json").is_file():
        pytest.skip(f"SmolLM2-135M-Instruct not fetched ({d}; `kvserve model fetch smollm2-135m-instruct`)")
    return d


@pytest.mark.parametrize("system", [False, True])
def test_smollm2_template_matches_transformers(smollm2, system):
    messages = [ChatMessage("user", QUESTION)]
    if system:
        messages.insert(0, ChatMessage("system", "Answer in one sentence."))
    text = ChatTemplate.from_dir(smollm2).render(messages)
    hf = transformers.AutoTokenizer.from_pretrained(str(smollm2))
    dicts = [{"role": m.role, "content": m.content} for m in messages]
    assert text == hf.apply_chat_template(dicts, tokenize=False, add_generation_prompt=True)
    ids = Tokenizer.from_dir(smollm2).encode(text, add_special_tokens=False)
    hf_ids = hf.apply_chat_template(dicts, tokenize=True, add_generation_prompt=True)
    assert ids == list(hf_ids["input_ids"] if hasattr(hf_ids, "keys") else hf_ids)


def test_smollm2_answers_paris_over_http(smollm2, ray_session):
    from kvserve.cluster.launch import start_cluster
    from kvserve.router.config import RouterConfig
    from kvserve.workers.engine.config import EngineConfig

    cl = start_cluster(
        EngineConfig(str(smollm2), num_gpu_blocks=64), 1, RouterConfig(port=0, model=str(smollm2)),
        http_port=0, ready_timeout_s=300,
    )  # fmt: skip
    try:
        with openai.OpenAI(base_url=f"http://127.0.0.1:{cl.http_port}/v1", api_key="-", max_retries=0,
                           timeout=120) as client:  # fmt: skip
            out = client.chat.completions.create(
                model=client.models.list().data[0].id,
                messages=[{"role": "user", "content": QUESTION}],
                max_tokens=32,
                temperature=0,
            )
        assert "Paris" in out.choices[0].message.content
        assert out.choices[0].finish_reason == "stop"  # <|im_end|>, well before max_tokens
    finally:
        cl.shutdown()
