"""workers/text/chat_template.py renders as HF transformers' apply_chat_template does (same template, same ids)."""

from __future__ import annotations

import json

import pytest

from kvserve.workers.models.random_model import IM_END_ID, IM_START_ID, write_tokenizer
from kvserve.workers.text.chat_template import ChatMessage, ChatTemplate, ChatTemplateError
from kvserve.workers.text.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

CONVERSATIONS = [
    [ChatMessage("user", "What is the capital of France?")],
    [
        ChatMessage("system", "You are terse."),
        ChatMessage("user", "Hi there"),
        ChatMessage("assistant", "Hello!"),
        ChatMessage("user", "Écris «ça» en 日本語 please"),
    ],
]

# A Llama-2-style template: raise_exception, loop variables, whitespace control and tojson.
LLAMA2_LIKE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}\n"
    "{% for message in loop_messages %}\n"
    "  {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n"
    "    {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}\n"
    "  {% endif %}\n"
    "  {% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}\n"
    "  {% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}\n"
    "{% endfor %}{% if tools is not none %}{{ tools | tojson }}{% endif %}"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    write_tokenizer(out)
    return out


def _hf(model_dir, template: str | None = None):
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    if template is not None:
        tok.chat_template = template
    return tok


def _as_dicts(messages):
    return [{"role": m.role, "content": m.content} for m in messages]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_random_model_chatml_matches_transformers(model_dir, messages, add_generation_prompt):
    ours = ChatTemplate.from_dir(model_dir)
    assert ours is not None
    hf = _hf(model_dir)
    text = ours.render(messages, add_generation_prompt=add_generation_prompt)
    expected = hf.apply_chat_template(_as_dicts(messages), tokenize=False, add_generation_prompt=add_generation_prompt)
    assert text == expected
    ids = Tokenizer.from_dir(model_dir).encode(text, add_special_tokens=False)
    hf_ids = hf.apply_chat_template(_as_dicts(messages), tokenize=True, add_generation_prompt=add_generation_prompt)
    hf_ids = hf_ids["input_ids"] if isinstance(hf_ids, dict) or hasattr(hf_ids, "keys") else hf_ids
    assert ids == list(hf_ids)
    assert ids.count(IM_START_ID) == len(messages) + add_generation_prompt
    assert ids.count(IM_END_ID) == len(messages)


def test_llama2_like_template_matches_transformers(model_dir, tmp_path):
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": LLAMA2_LIKE}))
    ours = ChatTemplate.from_dir(tmp_path)
    hf = _hf(model_dir, LLAMA2_LIKE)
    messages = CONVERSATIONS[1]
    assert ours.render(messages) == hf.apply_chat_template(_as_dicts(messages), tokenize=False,
                                                           add_generation_prompt=True)  # fmt: skip


def test_raise_exception_becomes_chat_template_error(model_dir):
    ours = ChatTemplate(LLAMA2_LIKE, {"bos_token": "<s>", "eos_token": "</s>"})
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        ours.render([ChatMessage("user", "a"), ChatMessage("user", "b")])


def test_sandbox_refuses_python_internals():
    evil = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        evil.render([ChatMessage("user", "x")])
    mutate = ChatTemplate("{{ messages.append(1) }}")
    with pytest.raises(ChatTemplateError):
        mutate.render([ChatMessage("user", "x")])


def test_bad_template_and_missing_template(tmp_path):
    with pytest.raises(ChatTemplateError, match="compile"):
        ChatTemplate("{% for %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert ChatTemplate.from_dir(tmp_path) is None


def test_jinja_file_wins_over_config(model_dir, tmp_path):
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").write_text("{{ eos_token }}{{ messages[0]['content'] }}")
    assert ChatTemplate.from_dir(tmp_path).render([ChatMessage("user", "q")]) == "</s>q"
