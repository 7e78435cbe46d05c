"""The OpenAI-compatible HTTP API (kvserve/router/api/http_api.py) end to end: a real Ray cluster, real HTTP on
127.0.0.1, the official ``openai`` package as the client.

One two-worker cluster (bearer token on, HTTP on a free port, a 1-request router queue so that a
single ``n=3`` request overflows it deterministically) serves every test; each test leaves it idle
(``wait_idle``: no used block, nothing running, block-pool integrity on every worker).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

import httpx
import pytest

from kvserve.cluster.client import KVServeClient
from kvserve.router.config import RouterConfig
from kvserve.workers.engine.config import EngineConfig
from kvserve.workers.text.chat_template import ChatMessage, ChatTemplate
from kvserve.workers.text.tokenizer import Tokenizer
from tests.integration.test_router import MAIN_BLOCKS, RPC_TIMEOUT, greedy, rand_prompt, wait_idle, wait_until

openai = pytest.importorskip("openai")

TOKEN = "test-token-42"
REPO = Path(__file__).resolve().parents[2]
QUESTION = "What is the capital of France?"


# ---- fixtures --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(ray_session, tiny_llama_dir):
    from kvserve.cluster.launch import start_cluster

    engine = EngineConfig(str(tiny_llama_dir), num_gpu_blocks=MAIN_BLOCKS)
    router = RouterConfig(port=0, model=str(tiny_llama_dir), auth_token=TOKEN, max_queue_requests=1)
    cl = start_cluster(engine, 2, router, http_port=0, metrics_port=0, ready_timeout_s=120)
    yield cl
    cl.shutdown()


@pytest.fixture(scope="module")
def base_url(cluster) -> str:
    assert cluster.http_port
    return f"http://127.0.0.1:{cluster.http_port}/v1"


@pytest.fixture(scope="module")
def oai(base_url):
    with openai.OpenAI(base_url=base_url, api_key=TOKEN, max_retries=0, timeout=RPC_TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module")
def grpc_client(cluster):
    with KVServeClient(cluster.address, auth_token=TOKEN, timeout=RPC_TIMEOUT, max_attempts=1) as c:
        yield c


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    from kvserve.workers.engine.engine import LLM

    return LLM(str(tiny_llama_dir), num_gpu_blocks=512)


@pytest.fixture(scope="module")
def model_name(oai) -> str:
    return oai.models.list().data[0].id


@pytest.fixture
def idle_after(grpc_client, cluster):
    yield
    wait_idle(grpc_client, cluster)


def _chat_ids(model_dir: Path, question: str) -> list[int]:
    """The chat prompt rendered and tokenized offline (the oracle for the router's rendering)."""
    text = ChatTemplate.from_dir(model_dir).render([ChatMessage("user", question)])
    return Tokenizer.from_dir(model_dir).encode(text, add_special_tokens=False)


def _x(usage) -> dict:
    return usage.model_extra


# ---- completions --------------------------------------------------------------------------------------
@pytest.mark.usefixtures("idle_after")
def test_completions_greedy_equal_offline_and_grpc(oai, grpc_client, llm, model_name):
    prompts = [rand_prompt(7000 + i, n) for i, n in enumerate((5, 23, 40))]
    expected = greedy(llm, prompts, 12)
    for prompt, exp in zip(prompts, expected, strict=True):
        out = oai.completions.create(
            model=model_name, prompt=prompt, max_tokens=12, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
        choice = out.choices[0]
        assert choice.model_extra["token_ids"] == exp.token_ids
        assert choice.text == exp.text and choice.finish_reason == "length"
        ids, text, final = grpc_client.generate_all(prompt, max_tokens=12, ignore_eos=True)
        assert ids == exp.token_ids and text == exp.text
        assert out.usage.prompt_tokens == final.usage.prompt_tokens == len(prompt)
        assert out.usage.completion_tokens == final.usage.completion_tokens == 12
        assert out.usage.total_tokens == len(prompt) + 12
        x = _x(out.usage)
        assert x["x-workers"][0] in ("worker-0", "worker-1")
        assert x["x-preemptions"] == x["x-swaps"] == x["x-migrations"] == 0
        assert out.usage.prompt_tokens_details.cached_tokens == x["x-cached-tokens"]


@pytest.mark.usefixtures("idle_after")
def test_completions_stream_equals_non_stream_with_usage(oai, model_name):
    prompt = rand_prompt(7100, 30)
    full = oai.completions.create(model=model_name, prompt=prompt, max_tokens=10, temperature=0,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    chunks = list(oai.completions.create(
        model=model_name, prompt=prompt, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ))  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (30, 10)
    assert all(c.usage is None for c in chunks[:-1])
    # Without include_usage: no usage chunk.
    plain = list(oai.completions.create(model=model_name, prompt=prompt, max_tokens=3, stream=True))
    assert all(c.usage is None and c.choices for c in plain)


@pytest.mark.usefixtures("idle_after")
def test_completions_text_prompts_n_and_logprobs(oai, grpc_client, model_name):
    out = oai.completions.create(model=model_name, prompt=["hello world", "kv cache"], max_tokens=4, n=2,
                                 temperature=0, logprobs=2, extra_body={"ignore_eos": True})  # fmt: skip
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text == out.choices[1].text  # greedy: n copies agree
    for c in out.choices:
        assert len(c.logprobs.tokens) == 4 == len(c.logprobs.token_logprobs)
        assert all(1 <= len(top) <= 3 for top in c.logprobs.top_logprobs)
    _, _, final = grpc_client.generate_all("hello world", max_tokens=4, ignore_eos=True)
    _, _, final2 = grpc_client.generate_all("kv cache", max_tokens=4, ignore_eos=True)
    # OpenAI counts each prompt once however many choices it has.
    assert out.usage.prompt_tokens == final.usage.prompt_tokens + final2.usage.prompt_tokens
    assert out.usage.completion_tokens == 16


# ---- chat -----------------------------------------------------------------------------------------------
@pytest.mark.usefixtures("idle_after")
def test_chat_equals_offline_and_grpc_stream_and_not(oai, grpc_client, llm, model_name, tiny_llama_dir):
    prompt_ids = _chat_ids(tiny_llama_dir, QUESTION)
    exp = greedy(llm, [prompt_ids], 10)[0]
    messages = [{"role": "user", "content": QUESTION}]
    out = oai.chat.completions.create(model=model_name, messages=messages, max_completion_tokens=10,
                                      temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == exp.text
    assert choice.model_extra["token_ids"] == exp.token_ids
    ids, text, final = grpc_client.generate_all(messages=[("user", QUESTION)], max_tokens=10, ignore_eos=True)
    assert ids == exp.token_ids and text == exp.text
    assert out.usage.prompt_tokens == final.usage.prompt_tokens == len(prompt_ids)
    assert out.usage.completion_tokens == final.usage.completion_tokens == 10

    chunks = list(oai.chat.completions.create(
        model=model_name, messages=messages, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "return_token_ids": True},
    ))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == exp.text
    assert [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]] == exp.token_ids
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.prompt_tokens == len(prompt_ids) and chunks[-1].usage.completion_tokens == 10


@pytest.mark.usefixtures("idle_after")
def test_chat_logprobs(oai, model_name):
    out = oai.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}],
                                      max_tokens=3, logprobs=True, top_logprobs=2,
                                      extra_body={"ignore_eos": True})  # fmt: skip
    content = out.choices[0].logprobs.content
    assert len(content) == 3
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


# ---- errors ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/completions", {"prompt": "x", "temperature": -1}, "temperature"),
        ("/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
        ("/completions", {"prompt": [1, 2, 99999999]}, "prompt"),
        ("/completions", {"prompt": ""}, "prompt"),
        ("/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/completions", {"prompt": "x", "n": 0}, "n"),
        ("/completions", {"prompt": "x", "top_k": 10**6}, "top_k"),
        ("/completions", {"prompt": "x", "user": "u" * 300}, "user"),
        ("/completions", {}, "prompt"),
        ("/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ("/chat/completions", {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": ""}]},
         "messages[1].content"),
        ("/chat/completions", {"messages": []}, "messages"),
        ("/chat/completions", {"messages": [{"role": "user", "content": "a"}], "stop": [""]}, "stop"),
        ("/chat/completions", {"messages": "hello"}, "messages"),
    ],
)
def test_bad_input_is_400_naming_the_field(base_url, path, body, param):
    r = httpx.post(base_url + path, json=body, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=RPC_TIMEOUT)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error" and err["message"]


def test_openai_client_sees_400_and_unknown_fields_are_ignored(oai, model_name):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=model_name, prompt="x", temperature=-3)
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"
    out = oai.completions.create(model=model_name, prompt="x", max_tokens=1,
                                 extra_body={"frobnicate": {"a": 1}, "logit_bias": {}})  # fmt: skip
    assert len(out.choices) == 1
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="no-such-model", prompt="x", max_tokens=1)


def test_no_or_wrong_token_is_401(base_url):
    with openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError) as e:
            c.completions.create(model="m", prompt="x", max_tokens=1)
        assert e.value.status_code == 401
    for path in ("/models", "/completions", "/chat/completions"):  # no Authorization header at all
        r = httpx.request("GET" if path == "/models" else "POST", base_url + path, json={}, timeout=RPC_TIMEOUT)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
    # Health is open (as gRPC's health service): probes carry no secret.
    assert httpx.get(base_url.removesuffix("/v1") + "/health", timeout=RPC_TIMEOUT).status_code == 200


@pytest.mark.usefixtures("idle_after")
def test_full_queue_is_429_with_retry_after(oai, grpc_client, model_name):
    """n=4 choices of a prompt that takes most of a worker's pool: the first two fill both workers,
    the third takes the 1-request queue and the fourth finds it full. The router admits the four in
    one synchronous pass (no pressure report can land between them), so the refusal is exact; the
    admitted three are cancelled with it (idle_after checks their blocks)."""
    prompt = rand_prompt(7300, 1700)  # 107 of 128 blocks
    before = grpc_client.status().router.rejections_total.get("queue_full_requests", 0)
    with pytest.raises(openai.RateLimitError) as e:
        oai.completions.create(model=model_name, prompt=prompt, max_tokens=4, n=4)
    assert e.value.status_code == 429
    headers = e.value.response.headers
    assert int(headers["retry-after"]) >= 1 and int(headers["retry-after-ms"]) > 0
    assert e.value.body["type"] == "rate_limit_error"
    st = grpc_client.status()
    assert st.router.rejections_total["queue_full_requests"] == before + 1


# ---- disconnects ----------------------------------------------------------------------------------------
def _generated_tokens(cluster) -> float:
    text = httpx.get(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=RPC_TIMEOUT).text
    return float(re.search(r"^kvserve:generation_tokens_total (\S+)$", text, re.M).group(1))


@pytest.mark.usefixtures("idle_after")
def test_disconnect_mid_stream_frees_the_blocks(base_url, grpc_client, cluster):
    body = {"prompt": rand_prompt(7400, 60), "max_tokens": 1800, "ignore_eos": True, "stream": True}
    before = _generated_tokens(cluster)
    with httpx.stream("POST", base_url + "/completions", json=body, headers={"Authorization": f"Bearer {TOKEN}"},
                      timeout=RPC_TIMEOUT) as r:  # fmt: skip
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["index"] == 0
        wait_until(lambda: any(w.report.used_blocks > 0 for w in grpc_client.status().workers), 30, "blocks in use")
    # The connection is closed: the request is aborted and its blocks freed (idle_after checks the rest).
    st = wait_idle(grpc_client, cluster, timeout=30)
    assert st.router.requests_in_flight == 0
    assert _generated_tokens(cluster) - before < 1800, "the request ran to its end: not aborted"


@pytest.mark.usefixtures("idle_after")
def test_disconnect_while_waiting_non_streamed_frees_the_blocks(cluster, grpc_client):
    body = json.dumps({"prompt": rand_prompt(7500, 60), "max_tokens": 1800, "ignore_eos": True}).encode()
    before = _generated_tokens(cluster)
    with socket.create_connection(("127.0.0.1", cluster.http_port), timeout=RPC_TIMEOUT) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {TOKEN}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        wait_until(lambda: any(w.report.num_running > 0 for w in grpc_client.status().workers), 30, "request running")
    wait_idle(grpc_client, cluster, timeout=30)
    assert _generated_tokens(cluster) - before < 1800, "the request ran to its end: not aborted"


# ---- the README's curl example ----------------------------------------------------------------------------
def test_readme_curl_example_streams(cluster):
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed (make setup installs it)")
    readme = (REPO / "README.md").read_text()
    m = re.search(r"<!-- openai-curl-example -->\s*```bash\n(.*?)```", readme, re.S)
    assert m, "README has no marked curl example"
    script = m.group(1).replace("127.0.0.1:8000", f"127.0.0.1:{cluster.http_port}")
    assert script.startswith("curl -N ")
    env = {**os.environ, "KVSERVE_AUTH_TOKEN": TOKEN}
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=RPC_TIMEOUT)
    assert out.returncode == 0, out.stderr
    events = [line[6:] for line in out.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[-1]["usage"]["completion_tokens"] > 0


# ---- metrics ----------------------------------------------------------------------------------------------
def test_http_requests_are_counted_by_route_and_status(base_url, cluster):
    assert httpx.get(base_url + "/models", timeout=RPC_TIMEOUT).status_code == 401
    text = httpx.get(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=RPC_TIMEOUT).text
    assert re.search(r'kvserve:http_requests_total\{route="/v1/models",status="401"\} [1-9]', text), text
    assert 'kvserve:http_request_duration_seconds_count{route="/v1/models"}' in text


# ---- kvserve generate --chat ----------------------------------------------------------------------------
@pytest.mark.usefixtures("idle_after")
def test_generate_chat_cli_local_and_server(cluster, llm, tiny_llama_dir, capsys):
    from kvserve.cluster.cli import main

    exp = greedy(llm, [_chat_ids(tiny_llama_dir, QUESTION)], 6)[0]
    flags = ["--chat", QUESTION, "--max-tokens", "6", "--ignore-eos", "--json"]
    assert main(["generate", "--model", str(tiny_llama_dir), "--num-gpu-blocks", "64", *flags]) == 0
    assert json.loads(capsys.readouterr().out) == [exp.token_ids]
    assert main(["generate", "--server", cluster.address, "--auth-token", TOKEN, *flags]) == 0
    assert json.loads(capsys.readouterr().out) == [exp.token_ids]
    assert main(["generate", "--server", cluster.address, "--auth-token", TOKEN, "--chat", QUESTION,
                 "--max-tokens", "2"]) == 0  # fmt: skip
    assert f"prompt: {QUESTION!r}" in capsys.readouterr().out


def test_grpc_chat_refusals_name_the_field(grpc_client):
    import grpc

    with pytest.raises(grpc.RpcError) as e:
        grpc_client.generate_all(messages=[("user", "a"), ("robot", "b")], max_tokens=1)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("prompt.messages[1].role:")


def _models_before_any_worker(config: RouterConfig) -> tuple[list[str], int]:
    """``/v1/models`` of a router that has no worker yet (as a client sees it while workers start),
    and the status of a completion sent then."""
    import asyncio

    from kvserve.router.api.server import RouterService

    async def ask() -> tuple[list[str], int]:
        service = RouterService(config, http_port=0, ready_timeout_s=0.0)
        await service.start()
        try:
            url = f"http://127.0.0.1:{await service.http_port()}/v1"
            headers = {"Authorization": f"Bearer {TOKEN}"}
            async with httpx.AsyncClient(timeout=RPC_TIMEOUT, headers=headers) as http:
                models = (await http.get(url + "/models")).json()["data"]
                early = await http.post(url + "/completions", json={"model": models[0]["id"], "prompt": "hi"})
            return [m["id"] for m in models], early.status_code
        finally:
            await service.stop()

    return asyncio.run(ask())


@pytest.mark.usefixtures("idle_after")
def test_model_listed_before_the_workers_are_ready_is_the_one_that_generates(oai, cluster, tiny_llama_dir):
    """A client that reads the model list at start-up (vllm bench serve, UIs, SDK wrappers) gets the
    name it will generate with: fixed from the start (default the --model argument), not a
    placeholder until the workers say hello. The short name (the last path component) works too."""
    config = RouterConfig(port=0, model=str(tiny_llama_dir), auth_token=TOKEN)
    early, status = _models_before_any_worker(config)
    assert early == [str(tiny_llama_dir)]
    assert status == 503  # no worker yet: unavailable, not "no such model"
    assert [m.id for m in oai.models.list().data] == early
    for name in (early[0], tiny_llama_dir.name):
        out = oai.completions.create(model=name, prompt="hello", max_tokens=2, temperature=0)
        assert out.choices[0].finish_reason in ("length", "stop") and out.model == early[0]
    named, _ = _models_before_any_worker(RouterConfig(port=0, model=str(tiny_llama_dir), served_model_name="tiny"))
    assert named == ["tiny"]
