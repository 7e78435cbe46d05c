"""Per-token cost of the OpenAI HTTP path against gRPC, on the same requests.

``python -m cluster.bench.http_overhead --model DIR [--pairs 30] [--tokens 32]`` starts a local
cluster (1 CPU worker, HTTP on a free port) and streams the same greedy request over gRPC
(``KVServeClient``) and over HTTP (SSE via ``httpx``) at the same time, so the one worker decodes
both in the same steps: token k's arrival-time difference (HTTP - gRPC) is then what the HTTP path
adds to each token's delivery (router-side JSON + uvicorn + client-side SSE parsing), free of the
decode time that dominates any end-to-end figure. Reported: the median over pairs of the per-pair
median difference, with the decode step for scale.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import random
import statistics
import threading
import time

import httpx


def _grpc_times(client, prompt: list[int], n: int, go: threading.Barrier) -> list[float]:
    """Arrival time of every token of one gRPC stream."""
    times: list[float] = []
    go.wait()
    for resp in client.generate(prompt, max_tokens=n, ignore_eos=True):
        now = time.perf_counter()
        times.extend(now for _ in resp.token_ids)
    return times


def _http_times(http: httpx.Client, url: str, prompt: list[int], n: int, go: threading.Barrier) -> list[float]:
    """Arrival time of every token of one SSE stream (one JSON chunk per router response)."""
    body = {"prompt": prompt, "max_tokens": n, "ignore_eos": True, "stream": True, "return_token_ids": True}
    times: list[float] = []
    go.wait()
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

    from cluster.client import KVServeClient
    from cluster.launch import start_cluster
    from cluster.serve_cli import init_ray
    from router.config import RouterConfig
    from workers.config import EngineConfig

    init_ray(None, num_cpus=4)  # a fresh local Ray, never one another process started
    cluster = start_cluster(
        EngineConfig(args.model, num_gpu_blocks=256), 1, RouterConfig(port=0, model=args.model), http_port=0
    )
    try:
        url = f"http://127.0.0.1:{cluster.http_port}/v1/completions"
        rng = random.Random(0)
        offsets, gaps = [], []
        with (
            KVServeClient(cluster.address, timeout=120) as client,
            httpx.Client(timeout=120) as http,
            cf.ThreadPoolExecutor(2) as pool,
        ):
            for i in range(args.pairs + 2):  # the first two pairs warm up
                prompt = [rng.randrange(3, 32000) for _ in range(args.prompt_len)]
                go = threading.Barrier(2)
                g = pool.submit(_grpc_times, client, prompt, args.tokens, go)
                h = pool.submit(_http_times, http, url, prompt, args.tokens, go)
                tg, th = g.result(), h.result()
                assert len(tg) == len(th) == args.tokens, (len(tg), len(th))
                if i >= 2:
                    # NOTE: both requests decode in the same steps (one worker batches them), so the
                    # arrival-time difference of token k is the delivery-latency difference alone.
                    offsets.append(statistics.median(b - a for a, b in zip(tg[1:], th[1:], strict=True)))
                    gaps.append(statistics.median(b - a for a, b in zip(tg, tg[1:], strict=False)))
        step = statistics.median(gaps)
        same_step = [o for o in offsets if abs(o) < step / 2]
        print(f"{len(offsets)} pairs x {args.tokens} tokens (prompt {args.prompt_len}), gRPC and HTTP concurrently")
        print(f"median decode step (gRPC inter-token gap): {step * 1e3:.2f} ms")
        print(f"median per-token arrival delay, HTTP - gRPC: {statistics.median(offsets) * 1e6:.0f} us "
              f"(pairs decoded in the same steps: {len(same_step)}/{len(offsets)}; their median: "
              f"{statistics.median(same_step) * 1e6 if same_step else float('nan'):.0f} us)")  # fmt: skip
    finally:
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
