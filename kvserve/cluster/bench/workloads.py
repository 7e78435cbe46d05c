"""The standard offline workloads for side-by-side benchmarks.

Random token-id prompts (seed 0), greedy, ``ignore_eos``, a fixed number of output tokens per request.
``kvserve bench offline --peer ...`` hands these exact prompts to the peer engine (``kvserve/cluster/bench/peers.py``),
so both sides always run the same requests. NOTE: the definition (counts, length ranges, seed, the order
of the RNG draws) is the one the figures in ``kvserve/cluster/bench/RESULTS.md`` were measured on; changing it
makes new figures incomparable with the old ones.
"""

from __future__ import annotations

import random

WORKLOADS = {
    "tiny": dict(n=64, lo=16, hi=256, out=64),
    "small": dict(n=32, lo=32, hi=512, out=128),
    # tiny's requests with 4x the output: the router's cost per streamed token at a fixed request count
    "tiny-256": dict(n=64, lo=16, hi=256, out=256),
    # time to first token of one long prompt: the run's seconds are the TTFT (output tok/s = 1 / TTFT)
    "prefill-2048": dict(n=1, lo=2048, hi=2048, out=1),
}


def prompts(name: str, vocab: int = 32000, seed: int = 0) -> tuple[list[list[int]], int]:
    """``(prompt token-id lists, output tokens per request)`` of workload ``name``."""
    w = WORKLOADS[name]
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(w["lo"], w["hi"]))] for _ in range(w["n"])], w["out"]
