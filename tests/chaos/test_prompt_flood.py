"""Max-size prompts cannot stall the router for other tenants (issue 42, finding 1), against the
router's real HTTP and gRPC surfaces in process with SmolLM2's tokenizer and chat template (no Ray:
a fake worker answers every request at once, see ``tests/chaos/test_schema_fuzz.py``).

Attacks tried:
- a 1.02 M-character prompt and a 1 M-character chat message of ``<|im_start|>`` (under the HTTP
  body limit, far over ``max_model_len``): refused by their size before any tokenizing;
- 5 over-long (but tokenizable) prompts on a key limited to 2 requests a minute: 2 are tokenized,
  the rest are refused by the rate limit first;
- two attacker processes sending max-size prompts and the largest chat messages that still get
  rendered, while another tenant streams: the router's own ``router_event_loop_held_seconds`` has no
  sample over 250 ms and every one of the victim's requests completes.
"""

from __future__ import annotations

import json
import multiprocessing
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from prometheus_client import REGISTRY

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.protos.kvserve.v1 import serving_pb2_grpc
from kvserve.router.gate.prompts import longest_token_bytes
from kvserve.router.gate.tenancy import hash_key
from tests.chaos.test_schema_fuzz import Served

MAX_MODEL_LEN = 4096  # as the review's server
KEY_ATTACKER, KEY_SLOW, KEY_VICTIM = "key-of-the-attacker", "key-of-a-slow-key", "key-of-the-victim"
ATTACK_S = 8.0  # NOTE: the attack's length (a bound on work, not a timing assertion)
VICTIM_REQUESTS = 40
# NOTE: 250 ms as tests/chaos/test_hostile_sizes.py: on a loaded 2-core machine a GIL hand-off to a thread
# the kernel descheduled counts as "held" (it is no run-queue wait of the loop thread), so one 100-250 ms sample
# happened under a concurrent CI run. The 100 ms target is measured by tests/chaos/prompt_flood_bench.py on a
# quieter machine; this test catches what tokenizing on the loop does (seconds for a max-size prompt).
HELD_LIMIT_S = 0.25


@pytest.fixture(scope="module")
def served(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps({"keys": [
        {"sha256": hash_key(KEY_ATTACKER), "tenant": "attacker"},
        {"sha256": hash_key(KEY_SLOW), "tenant": "slow", "requests_per_minute": 2},
        {"sha256": hash_key(KEY_VICTIM), "tenant": "victim"},
    ]}))  # fmt: skip
    s = Served(smollm2_dir, max_model_len=MAX_MODEL_LEN, auth_keys=str(keys))
    yield s
    s.close()


def _post(url: str, key: str, body: dict) -> httpx.Response:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    return httpx.post(url + path, json=body, headers={"authorization": f"Bearer {key}"}, timeout=120)


class CountingPrompts:
    """Counts the prompts handed to the router's tokenizing threads and processes (what the cheap
    checks must spare): wraps ``PromptPreparer``'s executors for the ``with`` block."""

    def __init__(self, served: Served) -> None:
        self.preparer, self.calls = served.service.bounds.prompts, 0

    def __enter__(self) -> CountingPrompts:
        counter = self

        class Counting:
            def __init__(self, pool: Any) -> None:
                self.pool = pool

            def submit(self, *args: Any, **kwargs: Any) -> Any:
                counter.calls += 1
                return self.pool.submit(*args, **kwargs)

        self._saved = self.preparer._pool, self.preparer._processes
        self.preparer._pool = Counting(self._saved[0])
        if self._saved[1] is not None:
            self.preparer._processes = Counting(self._saved[1])
        return self

    def __exit__(self, *exc: object) -> None:
        self.preparer._pool, self.preparer._processes = self._saved


def test_max_size_prompts_are_refused_before_tokenizing(served: Served) -> None:
    with CountingPrompts(served) as counted:
        text = _post(served.http_url, KEY_ATTACKER, {"prompt": "hello world " * 85_000, "max_tokens": 4})
        chat = _post(served.http_url, KEY_ATTACKER,
                     {"messages": [{"role": "user", "content": "<|im_start|>" * 85_000}], "max_tokens": 4})  # fmt: skip
    for resp, param in ((text, "prompt"), (chat, "messages")):
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert f"cannot fit max_model_len={MAX_MODEL_LEN}" in error["message"] and error["param"] == param, error
    assert counted.calls == 0, "a prompt that cannot fit was tokenized"


def test_a_keys_request_rate_is_charged_before_its_prompts_are_tokenized(served: Served) -> None:
    # NOTE: under the size bound (so only tokenizing can tell) and over max_model_len once tokenized
    text = "hello world " * 3_000  # 6,000 tokens
    assert len(text.encode()) < 2 * MAX_MODEL_LEN * longest_token_bytes(served.service.router.tokenizer)
    with CountingPrompts(served) as counted:
        codes = [_post(served.http_url, KEY_SLOW, {"prompt": text, "max_tokens": 4}) for _ in range(5)]
    assert [r.status_code for r in codes] == [400, 400, 429, 429, 429], [r.text for r in codes]
    assert "requests_per_minute" in codes[-1].json()["error"]["message"]
    assert counted.calls == 2, f"{counted.calls} prompts tokenized on a key allowed 2 requests a minute"


def _attacker(url: str, until: float, bodies: list[dict], out: multiprocessing.Queue) -> None:
    """One attacker process: sends ``bodies`` round-robin until ``until``; reports its statuses."""
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=url, timeout=120, headers={"authorization": f"Bearer {KEY_ATTACKER}"}) as client:
        i = 0
        while time.time() < until:
            body = bodies[i % len(bodies)]
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            code = client.post(path, json=body).status_code
            statuses[code] = statuses.get(code, 0) + 1
            i += 1
    out.put(statuses)


def _held_over(limit_s: float) -> float:
    """How many of the router's loop-held samples so far were over ``limit_s`` (a bucket bound)."""
    name = "kvserve:router_event_loop_held_seconds"
    count = REGISTRY.get_sample_value(f"{name}_count") or 0.0
    under = REGISTRY.get_sample_value(f"{name}_bucket", {"le": str(limit_s)}) or 0.0
    return count - under


def test_attackers_with_max_size_prompts_do_not_hold_the_loop_for_another_tenant(served: Served) -> None:
    bound = 2 * MAX_MODEL_LEN * longest_token_bytes(served.service.router.tokenizer)
    just_under = bound - 16
    bodies = [
        {"prompt": "hello world " * 85_000, "max_tokens": 4},  # 1.02 M characters
        {"messages": [{"role": "user", "content": "<|im_start|>" * 85_000}], "max_tokens": 4},
        # the largest that still get tokenized / rendered (then refused as too many tokens)
        {"prompt": ("hello world " * (just_under // 12 + 1))[:just_under], "max_tokens": 4},
        {"messages": [{"role": "user", "content": ("<|im_start|>" * (just_under // 12 + 1))[:just_under]}],
         "max_tokens": 4},
    ]  # fmt: skip
    ctx = multiprocessing.get_context("spawn")
    out: multiprocessing.Queue = ctx.Queue()
    before, collected = _held_over(HELD_LIMIT_S), list(served.gc_pauses.seconds)
    until = time.time() + ATTACK_S
    attackers = [ctx.Process(target=_attacker, args=(served.http_url, until, bodies, out)) for _ in range(2)]
    for p in attackers:
        p.start()
    done = 0
    with grpc.insecure_channel(served.grpc_address) as channel:
        stub = serving_pb2_grpc.KVServeStub(channel)
        md = (("authorization", f"Bearer {KEY_VICTIM}"),)
        while time.time() < until or done < VICTIM_REQUESTS:
            req = spb.GenerateRequest(text="The capital of France is", sampling=spb.SamplingParams(max_tokens=1))
            got = list(stub.Generate(req, metadata=md, timeout=60))
            assert got and got[-1].finish_reason, got
            done += 1
    statuses = [out.get(timeout=120) for _ in attackers]
    for p in attackers:
        p.join(60)
    assert all(code == 400 for s in statuses for code in s), statuses
    assert sum(n for s in statuses for n in s.values()) >= len(bodies), statuses  # each kind was sent
    held = _held_over(HELD_LIMIT_S) - before
    gc_s = [round(after - b, 3) for after, b in zip(served.gc_pauses.seconds, collected, strict=True)]
    assert held == 0, (
        f"the router's loop was held over {HELD_LIMIT_S * 1000:g} ms {held:g} times during the attack "
        f"(garbage collection in it, s by generation: {gc_s})"
    )
