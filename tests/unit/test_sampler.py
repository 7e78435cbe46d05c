"""Sampler and SamplingParams: greedy, seeds, top-k/top-p, temperature, validation."""

from __future__ import annotations

import pytest
import torch

from kvserve.workers.core.sampling_params import SamplingParams
from kvserve.workers.engine.sampler import Sampler, make_generator

VOCAB = 1000


def _logits(num_seqs: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_seqs, vocab, generator=g) * 3  # [num_seqs, vocab]


def test_greedy_is_argmax() -> None:
    logits = _logits(8)
    params = [SamplingParams(temperature=0.0)] * 8
    assert Sampler()(logits, params, [None] * 8) == logits.argmax(-1).tolist()


def test_mixed_batch_greedy_rows_are_argmax_and_logits_untouched() -> None:
    logits = _logits(6)
    before = logits.clone()
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0, seed=i) for i in range(6)]
    gens = [make_generator(p.seed) for p in params]
    out = Sampler()(logits, params, gens)
    argmax = logits.argmax(-1).tolist()
    assert [out[i] for i in (0, 2, 4)] == [argmax[i] for i in (0, 2, 4)]
    assert torch.equal(logits, before)


def test_empty_batch() -> None:
    assert Sampler()(torch.empty(0, VOCAB), [], []) == []


def test_length_mismatch_raises() -> None:
    with pytest.raises(ValueError):
        Sampler()(_logits(2), [SamplingParams()], [None, None])
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(VOCAB), [SamplingParams()], [None])


def _run_seeded(rows: list[torch.Tensor], params: list[SamplingParams], steps: int) -> list[list[int]]:
    """Sample ``steps`` times for a batch; per-row generators persist across steps."""
    sampler = Sampler()
    gens = [make_generator(p.seed) for p in params]
    logits = torch.stack(rows)
    out: list[list[int]] = [[] for _ in rows]
    for _ in range(steps):
        for i, t in enumerate(sampler(logits, params, gens)):
            out[i].append(t)
    return out


def test_seed_reproducible_across_batch_composition() -> None:
    logits = _logits(5, seed=1)
    target = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=1234)
    alone = _run_seeded([logits[0]], [target], steps=20)[0]

    # Same row, same seed, but other seeded/unseeded/greedy neighbours and a different position.
    others = [
        SamplingParams(temperature=0.7, seed=7),
        SamplingParams(temperature=1.3),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_p=0.5, seed=99),
    ]
    rows = [logits[1], logits[2], logits[0], logits[3], logits[4]]
    batch = _run_seeded(rows, [others[0], others[1], target, others[2], others[3]], steps=20)
    assert batch[2] == alone
    assert len(set(alone)) > 1  # really random, not collapsed to greedy

    # A different seed gives a different stream.
    other_seed = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=4321)
    assert _run_seeded([logits[0]], [other_seed], steps=20)[0] != alone


def test_top_k_one_equals_greedy() -> None:
    logits = _logits(16, seed=2)
    params = [SamplingParams(temperature=1.5, top_k=1, seed=i) for i in range(16)]
    out = Sampler()(logits, params, [make_generator(p.seed) for p in params])
    assert out == logits.argmax(-1).tolist()


def test_tiny_top_p_equals_greedy() -> None:
    logits = _logits(16, seed=3)
    params = [SamplingParams(temperature=1.0, top_p=1e-6) for _ in range(16)]
    out = Sampler()(logits, params, [None] * 16)
    assert out == logits.argmax(-1).tolist()


def test_greedy_ties_pick_lowest_id_even_with_top_k() -> None:
    logits = torch.zeros(2, 10)
    logits[:, 3] = logits[:, 7] = 5.0
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=1)]
    assert Sampler()(logits, params, [None, None]) == [3, 3]


def test_top_k_restricts_support() -> None:
    logits = _logits(1, seed=4).expand(2000, VOCAB).contiguous()
    allowed = set(logits[0].topk(5).indices.tolist())
    params = [SamplingParams(temperature=2.0, top_k=5)] * 2000
    torch.manual_seed(0)
    out = Sampler()(logits, params, [None] * 2000)
    assert set(out) == allowed  # every one of the 5 shows up at temperature 2, nothing else


def test_top_p_restricts_support_to_nucleus() -> None:
    # probs 0.5, 0.3, 0.15, 0.05: top_p=0.7 keeps {0, 1}; 0.8 keeps {0, 1} (mass before 2 is 0.8).
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(3000, 4).contiguous()
    g = make_generator(0)
    for top_p, expected in ((0.7, {0, 1}), (0.8, {0, 1}), (0.81, {0, 1, 2})):
        params = [SamplingParams(top_p=top_p)] * 3000
        out = Sampler()(logits, params, [g] * 3000)
        assert set(out) == expected, top_p


def test_temperature_one_matches_softmax() -> None:
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05])
    n = 20000
    logits = probs.log().expand(n, 4).contiguous()
    torch.manual_seed(123)
    out = torch.tensor(Sampler()(logits, [SamplingParams()] * n, [None] * n))
    freq = torch.bincount(out, minlength=4).float() / n
    assert torch.allclose(freq, probs, atol=0.015), freq


def test_temperature_sharpens_and_flattens() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0]).expand(20000, 4).contiguous()

    def top_freq(temperature: float) -> float:
        gens = [make_generator(5)] * 20000  # one shared seeded stream: deterministic test
        params = [SamplingParams(temperature=temperature)] * 20000
        out = torch.tensor(Sampler()(logits, params, gens))
        return (out == 0).float().mean().item()

    expected = torch.softmax(logits[0], -1)[0].item()  # ~0.64
    assert top_freq(0.25) > 0.95
    assert abs(top_freq(1.0) - expected) < 0.02
    assert top_freq(10.0) < 0.35  # close to uniform 0.25


def test_make_generator() -> None:
    assert make_generator(None) is None
    a, b = make_generator(42), make_generator(42)
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))


# --- SamplingParams -----------------------------------------------------------------------


def test_params_defaults_and_greedy() -> None:
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.seed) == (16, 1.0, 0, 1.0, None)
    assert not p.greedy
    assert SamplingParams(temperature=0).greedy


def test_params_lists_become_tuples() -> None:
    p = SamplingParams(stop=["a", "bc"], stop_token_ids=[5, 6])  # type: ignore[arg-type]
    assert p.stop == ("a", "bc") and p.stop_token_ids == (5, 6)
    hash(p)  # frozen and hashable


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"stop": "END"}, "stop"),
        ({"stop": ("",)}, "stop"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
    ],
)
def test_params_validation_names_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


# --- TokenRNG: reproducible from (seed, output index) ----------------------------------------


def test_token_rng_is_a_function_of_seed_and_index() -> None:
    from kvserve.workers.engine.sampler import TokenRNG, make_token_rng

    assert make_token_rng(None) is None
    a, b = TokenRNG(42), TokenRNG(42)
    draws_a = [torch.rand(4, generator=a.at(i)) for i in range(6)]
    # b jumps straight to index 5, then back to 2: no history, no advancing state.
    assert torch.equal(torch.rand(4, generator=b.at(5)), draws_a[5])
    assert torch.equal(torch.rand(4, generator=b.at(2)), draws_a[2])
    assert not torch.equal(draws_a[0], draws_a[1])
    with pytest.raises(ValueError):
        a.at(-1)


def test_token_rng_seeds_differing_in_high_bits_differ() -> None:
    """mt19937 keeps only 32 bits of its seed; the mix must still tell these apart."""
    from kvserve.workers.engine.sampler import TokenRNG, token_seed

    x, y = TokenRNG(1), TokenRNG(1 + 2**32)
    assert not torch.equal(torch.rand(8, generator=x.at(0)), torch.rand(8, generator=y.at(0)))
    low32 = {token_seed(s, i) & 0xFFFFFFFF for s in range(50) for i in range(50)}
    assert len(low32) == 2500


def test_seeded_replay_from_index_matches_a_continuous_run() -> None:
    """Sampling token i with TokenRNG.at(i) gives the same tokens whether the run started at 0 or
    resumes at i (what a replay on another worker does)."""
    from kvserve.workers.engine.sampler import TokenRNG

    logits = _logits(1, seed=9)
    params = [SamplingParams(temperature=1.0, seed=3)]
    full = [Sampler()(logits, params, [TokenRNG(3).at(i)])[0] for i in range(12)]
    resumed_rng = TokenRNG(3)
    assert [Sampler()(logits, params, [resumed_rng.at(i)])[0] for i in range(7, 12)] == full[7:]
    assert len(set(full)) > 1  # the noise really changes per index
