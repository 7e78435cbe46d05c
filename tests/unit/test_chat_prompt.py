"""The router's chat input: GenerateRequest.messages validated, rendered and tokenized
(``kvserve.router.gate.prompts.prompt_ids``), every refusal a ValidationError naming its field."""

from __future__ import annotations

import pytest

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.router.config import RouterConfig
from kvserve.router.gate.prompts import prompt_ids
from kvserve.router.gate.validation import MAX_CHAT_MESSAGES, ModelLimits, ValidationError
from kvserve.router.requests.router import Router
from kvserve.workers.models.random_model import IM_START_ID, write_tokenizer
from kvserve.workers.text.chat_template import ChatMessage, ChatTemplate
from kvserve.workers.text.tokenizer import Tokenizer

LIMITS = ModelLimits(vocab_size=32000, max_model_len=4096)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def router(model_dir) -> Router:
    return Router(RouterConfig(), LIMITS, Tokenizer.from_dir(model_dir), ChatTemplate.from_dir(model_dir))


def _ids(router: Router, request: spb.GenerateRequest) -> list[int]:
    return prompt_ids(request, router.limits, router.tokenizer, router.chat_template)


def chat(*pairs: tuple[str, str]) -> spb.GenerateRequest:
    return spb.GenerateRequest(
        messages=spb.ChatMessages(messages=[spb.ChatMessage(role=r, content=c) for r, c in pairs])
    )


def test_chat_renders_then_tokenizes_without_extra_specials(router, model_dir):
    ids = _ids(router, chat(("system", "Be brief."), ("user", "Hi")))
    text = ChatTemplate.from_dir(model_dir).render([ChatMessage("system", "Be brief."), ChatMessage("user", "Hi")])
    assert ids == Tokenizer.from_dir(model_dir).encode(text, add_special_tokens=False)
    assert ids[0] == 1 and ids[1] == IM_START_ID  # the template's BOS, not a second one from the tokenizer
    assert ids.count(IM_START_ID) == 3  # two turns + the opened assistant turn


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (chat(), "prompt.messages"),
        (chat(("user", "a"), ("robot", "b")), "prompt.messages[1].role"),
        (chat(("user", "")), "prompt.messages[0].content"),
        (chat(*[("user", "a")] * (MAX_CHAT_MESSAGES + 1)), "prompt.messages"),
        (chat(("user", " ".join(str(i) for i in range(4000)))), "prompt.messages"),  # > max_model_len tokens
    ],
)
def test_bad_chats_name_their_field(router, request_, field):
    with pytest.raises(ValidationError) as e:
        _ids(router, request_)
    assert e.value.field == field


def test_template_errors_and_missing_template_are_validation_errors(model_dir):
    tok = Tokenizer.from_dir(model_dir)
    strict = ChatTemplate("{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}{% endif %}x")
    with pytest.raises(ValidationError, match="system first") as e:
        _ids(Router(RouterConfig(), LIMITS, tok, strict), chat(("user", "hi")))
    assert e.value.field == "prompt.messages"
    with pytest.raises(ValidationError, match="no chat template") as e:
        _ids(Router(RouterConfig(), LIMITS, tok, None), chat(("user", "hi")))
    assert e.value.field == "prompt.messages"
