"""The prompts and greedy parameters the model tests share (HF parity, decode graphs, tensor parallelism):
one definition, so every suite asks the conftest oracle (``hf_greedy``) for the same prompts and its cache
serves them all."""

from __future__ import annotations

import torch

from kvserve.workers.core.sampling_params import SamplingParams

N = 24  # new tokens per request (the conftest oracle's maximum, HF_MAX_NEW_TOKENS, so all tests share its cache)
GREEDY = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
BUCKETS = (1, 2, 4)  # decode-graph buckets: small, so most decode steps are padded and some fall back


def rand_ids(n: int, seed: int) -> list[int]:
    """``n`` token ids in [0, 32000), the same for the same seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 32000, (n,), generator=g).tolist()


MIXED = [rand_ids(n, 100 + i) for i, n in enumerate((15, 16, 17, 3, 40, 1))]  # around the 16-token block edge
PREFIX = rand_ids(32, 7)  # two 16-token blocks; 32 blocks of size 1
PREFIX_A = PREFIX + rand_ids(5, 8)
PREFIX_B = PREFIX + rand_ids(11, 9)
assert PREFIX_A[32] != PREFIX_B[32]  # the shared part is exactly PREFIX
