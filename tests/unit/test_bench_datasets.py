"""kvserve/cluster/bench/datasets.py: shapes, determinism, the ideal prefix-hit yardstick."""

from __future__ import annotations

import math
import statistics

import pytest

from kvserve.cluster.bench.datasets import (
    DatasetConfig,
    arrival_times,
    build_dataset,
    ideal_cached_tokens,
    max_prompt_len,
    schedule_digest,
    zipf_weights,
)


def _gsp(**kw) -> DatasetConfig:
    base = dict(name="shared-prefix", vocab_size=1000, gsp_num_groups=3, gsp_prompts_per_group=4,
                gsp_system_prompt_len=32, gsp_question_len=8, gsp_output_len=5)  # fmt: skip
    return DatasetConfig(**{**base, **kw})


def test_shared_prefix_shape_and_ideal_hits() -> None:
    convs = build_dataset(_gsp(), seed=1)
    reqs = [c.rounds[0] for c in convs]
    assert len(reqs) == 12
    assert sorted(r.group for r in reqs).count(0) == 4
    by_group: dict[int, set] = {}
    for r in reqs:
        assert len(r.prompt) == 40 and r.max_tokens == 5
        by_group.setdefault(r.group, set()).add(r.prompt[:32])
    assert all(len(s) == 1 for s in by_group.values()) and len({next(iter(s)) for s in by_group.values()}) == 3
    # First request of each group hits nothing; each later one hits the 32-token system prompt (8 blocks of 4).
    ideal = ideal_cached_tokens([(r.tenant, r.prompt, [1, 2, 3, 4, 5]) for r in reqs], block_size=4)
    assert ideal == 3 * 3 * 32
    # A system prompt that is not block-aligned: only whole blocks hit (30 tokens -> 7 blocks of 4).
    reqs30 = [c.rounds[0] for c in build_dataset(_gsp(gsp_system_prompt_len=30), seed=1)]
    assert ideal_cached_tokens([(r.tenant, r.prompt, []) for r in reqs30], block_size=4) == 9 * 28


def test_tenants_salt_the_ideal() -> None:
    reqs = [c.rounds[0] for c in build_dataset(_gsp(tenants=2), seed=3)]
    assert {r.tenant for r in reqs} == {"tenant-0", "tenant-1"}
    firsts = len({(r.tenant, r.group) for r in reqs})
    assert ideal_cached_tokens([(r.tenant, r.prompt, []) for r in reqs], 4) == (12 - firsts) * 32


def test_ideal_caps_at_last_prompt_token_and_counts_outputs() -> None:
    # Identical block-aligned prompts: the last token is always computed, so 1 block of 2 can hit.
    assert ideal_cached_tokens([("", [1, 2, 3, 4, 5, 6, 7, 8], []), ("", [1, 2, 3, 4, 5, 6, 7, 8], [])], 4) == 4
    # A follow-up extending prompt + output (minus the last sampled token) hits all of it.
    sent = [("", [1, 2, 3, 4], [5, 6, 7, 8, 9]), ("", [1, 2, 3, 4, 5, 6, 7, 8, 10, 11], [])]
    assert ideal_cached_tokens(sent, 4) == 8
    with pytest.raises(ValueError):
        ideal_cached_tokens([], 0)


def test_multi_turn_shape() -> None:
    cfg = DatasetConfig(name="multi-turn", vocab_size=500, mt_num_users=3, mt_num_rounds=4, mt_system_prompt_len=20,
                        mt_question_len=6, mt_output_len=7)  # fmt: skip
    convs = build_dataset(cfg, seed=0)
    assert len(convs) == 3 and all(c.chained and len(c.rounds) == 4 for c in convs)
    assert [len(r.prompt) for r in convs[0].rounds] == [26, 6, 6, 6]
    assert [r.round for r in convs[0].rounds] == [0, 1, 2, 3] and {r.group for r in convs[1].rounds} == {1}
    # Round 4's prompt: 26 + 3 * (7 answer + 6 question) tokens.
    assert max_prompt_len(convs) == 26 + 3 * 13


def test_zipf_popularity_skews_groups() -> None:
    reqs = [c.rounds[0] for c in build_dataset(_gsp(gsp_num_groups=8, gsp_prompts_per_group=50, zipf_s=1.1), 0)]
    counts = [sum(r.group == g for r in reqs) for g in range(8)]
    assert counts[0] > 2 * counts[7]
    assert zipf_weights(3, 1.0) == pytest.approx([6 / 11, 3 / 11, 2 / 11])


def test_arrivals_deterministic_and_mean_rate() -> None:
    a = arrival_times(2000, rate=10.0, burstiness=1.0, seed=5)
    assert a == arrival_times(2000, rate=10.0, burstiness=1.0, seed=5)
    assert a != arrival_times(2000, rate=10.0, burstiness=1.0, seed=6)
    assert all(x <= y for x, y in zip(a, a[1:], strict=False))
    gaps = [y - x for x, y in zip([0.0, *a], a, strict=False)]
    assert statistics.fmean(gaps) == pytest.approx(0.1, rel=0.1)
    bursty = [y - x for x, y in zip([0.0, *a], arrival_times(2000, 10.0, 0.25, 5), strict=False)]
    assert statistics.stdev(bursty) > statistics.stdev(gaps)
    assert arrival_times(3, math.inf) == [0.0, 0.0, 0.0]
    for bad in (dict(n=1, rate=0), dict(n=1, rate=1, burstiness=0), dict(n=-1, rate=1)):
        with pytest.raises(ValueError):
            arrival_times(**bad)


def test_dataset_determinism_and_digest() -> None:
    cfg = DatasetConfig(name="random", vocab_size=100, num_prompts=5, input_len_min=3, input_len_max=9)
    a, b = build_dataset(cfg, 7), build_dataset(cfg, 7)
    assert a == b and a != build_dataset(cfg, 8)
    t = arrival_times(5, 2.0, seed=7)
    assert schedule_digest(a, t) == schedule_digest(b, t) != schedule_digest(a, arrival_times(5, 2.0, seed=8))


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="dataset"):
        DatasetConfig(name="nope")
    with pytest.raises(ValueError, match="input_len_max"):
        DatasetConfig(input_len_min=10, input_len_max=5)
    with pytest.raises(ValueError, match="zipf"):
        DatasetConfig(zipf_s=0)
