"""Per-token cost of the OpenAI HTTP path against gRPC, on the same requests.

``python -m kvserve.cluster.bench.http_overhead --model DIR [--pairs 30] [--tokens 32]`` starts a local
cluster (1 CPU worker, HTTP on a free port) and streams the same greedy request over gRPC
(``KVServeClient``) and over HTTP (SSE via ``httpx``, one JSON chunk per router response), one
request at a time, alternating which goes first. Per request: stream time (send to last token) /
tokens. Reported: each path's median and the median of the paired differences (HTTP - gRPC): what
the HTTP path adds per token end to end (router-side JSON + uvicorn + client-side SSE parsing).

NOTE: streaming both at once (so the one worker decodes them in the same steps) looked cleaner but
is biased: the two arrive at the router a step apart often enough to swamp a sub-millisecond cost.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from functools import partial

import httpx


def _grpc_times(client, prompt: list[int], n: int) -> list[float]:
    """Arrival time of every token of one gRPC stream."""
    times: list[float] = []
    for resp in client.generate(prompt, max_tokens=n, ignore_eos=True):
        now = time.perf_counter()
        times.extend(now for _ in resp.token_ids)
    return times


def _http_times(http: httpx.Client, url: str, prompt: list[int], n: int) -> list[float]:
    """Arrival time of every token of one SSE stream (one JSON chunk per router response)."""
    body = {"prompt": prompt, "max_tokens": n, "ignore_eos": True, "stream": True, "return_token_ids": True}
    times: list[float] = []
    with http.stream("POST", url, json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                now = time.perf_counter()
                times.extend(now for _ in json.loads(line[6:])["choices"][0]["token_ids"])
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--pairs", type=int, default=30)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    args = p.parse_args(argv)

    from kvserve.cluster.client import KVServeClient
    from kvserve.cluster.launch import start_cluster
    from kvserve.cluster.serve_cli import init_ray
    from kvserve.router.config import RouterConfig
    from kvserve.workers.engine.config import EngineConfig

    init_ray(None, num_cpus=4)  # a fresh local Ray, never one another process started
    cluster = start_cluster(
        EngineConfig(args.model, num_gpu_blocks=256), 1, RouterConfig(port=0, model=args.model), http_port=0
    )
    try:
        url = f"http://127.0.0.1:{cluster.http_port}/v1/completions"
        rng = random.Random(0)
        pairs = []
        with KVServeClient(cluster.address, timeout=120) as client, httpx.Client(timeout=120) as http:
            for i in range(args.pairs + 2):  # the first two pairs warm up
                prompt = [rng.randrange(3, 32000) for _ in range(args.prompt_len)]
                # NOTE: one request at a time, alternating which path goes first, so a drift in the
                # machine's load hits both alike; the same prompt on both (its second run may hit the
                # prefix cache, so the order alternates for that too).
                runs = [partial(_grpc_times, client, prompt, args.tokens),
                        partial(_http_times, http, url, prompt, args.tokens)]  # fmt: skip
                t0 = [0.0, 0.0]
                out: list[list[float]] = [[], []]
                for j in ((0, 1) if i % 2 == 0 else (1, 0)):
                    t0[j] = time.perf_counter()
                    out[j] = runs[j]()
                assert len(out[0]) == len(out[1]) == args.tokens, (len(out[0]), len(out[1]))
                if i >= 2:
                    pairs.append([(times[-1] - start) / args.tokens for times, start in zip(out, t0, strict=True)])
        per_tok_g = [g for g, _ in pairs]
        per_tok_h = [h for _, h in pairs]
        diff = [h - g for g, h in pairs]
        print(f"{len(pairs)} pairs x {args.tokens} tokens (prompt {args.prompt_len}), one request at a time")
        print(f"median stream time per token: gRPC {statistics.median(per_tok_g) * 1e3:.3f} ms, "
              f"HTTP {statistics.median(per_tok_h) * 1e3:.3f} ms")  # fmt: skip
        print(f"median paired difference (HTTP - gRPC): {statistics.median(diff) * 1e6:.0f} us/token "
              f"(quartiles {statistics.quantiles(diff, n=4)[0] * 1e6:.0f} .. "
              f"{statistics.quantiles(diff, n=4)[2] * 1e6:.0f} us)")  # fmt: skip
    finally:
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
