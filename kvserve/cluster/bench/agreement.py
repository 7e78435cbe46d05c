"""How far two runs' output tokens agree (the peer comparison, lossy levers, the GPU check)."""

from __future__ import annotations


def token_agreement(ours: list[list[int]], reference: list[list[int]]) -> float:
    """Share of output positions where two runs chose the same token (a quality figure for lossy
    levers such as an fp8 KV cache, where tokens may legitimately differ)."""
    if len(ours) != len(reference):
        raise ValueError(f"{len(ours)} outputs vs {len(reference)} in the reference")
    same = total = 0
    for a, b in zip(ours, reference, strict=True):
        total += max(len(a), len(b))
        same += sum(x == y for x, y in zip(a, b, strict=False))
    return same / total if total else 1.0
