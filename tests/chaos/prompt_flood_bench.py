"""Bench (not a test): another tenant's stream while two attacker processes send max-size prompts
and chat messages (issue 42), against the router in process with SmolLM2's tokenizer and template
and a fake worker that streams ``TOKENS`` tokens ``STEP_S`` apart (so what is measured is what the
router adds, not a model's speed).

    PYTHONPATH=. .venv/bin/python tests/chaos/prompt_flood_bench.py [--attack-s 20] [--unfixed]

Prints the victim's TTFT p50 and inter-token latency (mean, p99) idle and under attack, their
ratios, and how many of the router's ``router_event_loop_held_seconds`` samples passed 100 ms.
``--unfixed`` runs the router as before issue 42 (no size check before tokenizing, tokenizing and
rendering in threads) for comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.protos.kvserve.v1 import serving_pb2_grpc
from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.router.gate import prompt_preparer as gate_preparer
from kvserve.router.gate import prompts as gate_prompts
from kvserve.router.gate.prompts import longest_token_bytes
from kvserve.router.gate.tenancy import hash_key
from tests.chaos import test_schema_fuzz
from tests.chaos.test_prompt_flood import _attacker, _held_over

TOKENS, STEP_S = 48, 0.005
KEY_ATTACKER, KEY_VICTIM = "key-of-the-attacker", "key-of-the-victim"


class StreamingWorker(test_schema_fuzz.AnsweringWorker):
    """Answers each request with ``TOKENS`` tokens, one per ``STEP_S`` (a decode step)."""

    def __getattr__(self, name: str) -> Any:
        router = self.service.router

        class Method:
            def remote(self, *args: Any, **kwargs: Any) -> asyncio.Future:
                loop = asyncio.get_running_loop()
                requests = [args[0]] if name == "add_request" else args[0] if name == "add_requests" else []
                for rid in [request.request_id for request in requests]:
                    for i in range(1, TOKENS + 1):
                        out = pb.RequestOutput(request_id=rid, new_token_ids=[1], num_output_tokens=i,
                                               finish_reason="length" if i == TOKENS else "",
                                               num_prompt_tokens=1)  # fmt: skip
                        loop.call_later(i * STEP_S, router._on_output, "w", out)
                fut = loop.create_future()
                fut.set_result([None] * len(requests) if name == "add_requests" else None)
                return fut

        return Method()


def _victim(address: str, seconds: float) -> tuple[list[float], list[float]]:
    """Sequential streams for ``seconds``: (TTFTs, inter-token gaps)."""
    ttft, gaps = [], []
    md = (("authorization", f"Bearer {KEY_VICTIM}"),)
    with grpc.insecure_channel(address) as channel:
        stub = serving_pb2_grpc.KVServeStub(channel)
        until = time.time() + seconds
        while time.time() < until:
            req = spb.GenerateRequest(text="The capital of France is", sampling=spb.SamplingParams(max_tokens=TOKENS))
            t0 = last = time.perf_counter()
            first = True
            for _ in stub.Generate(req, metadata=md, timeout=120):
                now = time.perf_counter()
                if first:
                    ttft.append(now - t0)
                    first = False
                else:
                    gaps.append(now - last)
                last = now
    return ttft, gaps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--attack-s", type=float, default=20.0)
    ap.add_argument("--idle-s", type=float, default=10.0)
    ap.add_argument("--unfixed", action="store_true")
    args = ap.parse_args()
    from kvserve.cluster.model_fetch import fetch

    model = fetch("smollm2-135m-instruct", "float32", quiet=True)
    keys = Path(tempfile.mkdtemp()) / "keys.json"
    keys.write_text(json.dumps({"keys": [{"sha256": hash_key(KEY_ATTACKER), "tenant": "attacker"},
                                         {"sha256": hash_key(KEY_VICTIM), "tenant": "victim"}]}))  # fmt: skip
    test_schema_fuzz.AnsweringWorker = StreamingWorker  # type: ignore[misc]
    served = test_schema_fuzz.Served(model, max_model_len=4096, auth_keys=str(keys))
    try:
        if args.unfixed:  # NOTE: as before issue 42: no size check first, prompts in threads
            gate_preparer.check_prompt_size = gate_prompts.check_prompt_size = lambda *a: None  # type: ignore[assignment]
            served.service.bounds.prompts._processes = None
        bound = 2 * 4096 * (longest_token_bytes(served.service.router.tokenizer) or 1)
        ju = bound - 16
        bodies = [
            {"prompt": "hello world " * 85_000, "max_tokens": 4},
            {"messages": [{"role": "user", "content": "<|im_start|>" * 85_000}], "max_tokens": 4},
            {"prompt": ("hello world " * (ju // 12 + 1))[:ju], "max_tokens": 4},
            {"messages": [{"role": "user", "content": ("<|im_start|>" * (ju // 12 + 1))[:ju]}], "max_tokens": 4},
        ]
        _victim(served.grpc_address, 0.1)  # NOTE: warm-up: the first prompt waits for the prompt processes' start
        idle_ttft, idle_gaps = _victim(served.grpc_address, args.idle_s)
        ctx = multiprocessing.get_context("spawn")
        out: multiprocessing.Queue = ctx.Queue()
        held_before = _held_over(0.1)
        until = time.time() + args.attack_s
        attackers = [ctx.Process(target=_attacker, args=(served.http_url, until, bodies, out)) for _ in range(2)]
        for p in attackers:
            p.start()
        time.sleep(1.0)  # NOTE: bench only: let the attackers' first requests arrive
        att_ttft, att_gaps = _victim(served.grpc_address, args.attack_s - 1.0)
        statuses = [out.get(timeout=300) for _ in attackers]
        for p in attackers:
            p.join(60)
        held = _held_over(0.1) - held_before

        def p(xs: list[float], q: float) -> float:
            return statistics.quantiles(xs, n=100)[q - 1] if len(xs) > 1 else xs[0]

        print(f"mode: {'unfixed (before issue 42)' if args.unfixed else 'fixed'}")
        print(f"idle:   {len(idle_ttft)} streams, TTFT p50 {statistics.median(idle_ttft) * 1e3:.1f} ms, "
              f"ITL mean {statistics.mean(idle_gaps) * 1e3:.2f} ms p99 {p(idle_gaps, 99) * 1e3:.1f} ms")  # fmt: skip
        print(f"attack: {len(att_ttft)} streams, TTFT p50 {statistics.median(att_ttft) * 1e3:.1f} ms, "
              f"ITL mean {statistics.mean(att_gaps) * 1e3:.2f} ms p99 {p(att_gaps, 99) * 1e3:.1f} ms")  # fmt: skip
        print(f"ratios: TTFT p50 {statistics.median(att_ttft) / statistics.median(idle_ttft):.2f}x, "
              f"ITL mean {statistics.mean(att_gaps) / statistics.mean(idle_gaps):.2f}x")  # fmt: skip
        print(f"attacker statuses: {statuses}; loop-held samples > 100 ms during the attack: {held:g}")
    finally:
        served.close()


if __name__ == "__main__":
    main()
