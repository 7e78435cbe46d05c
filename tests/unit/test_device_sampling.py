"""Sampling on the device with one device→host read per step (issue 37 item 3, first half).

The sampler leaves its ids on the logits' device (``Sampler.sample``) and the runner reads a step's
ids back once (``host_ids.HostIds``), whatever mix of greedy, seeded and unseeded rows it holds.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve.workers.core.sampling_params import SamplingParams
from kvserve.workers.engine.engine import LLM
from kvserve.workers.engine.host_ids import HostIds
from kvserve.workers.engine.sampler import Sampler, make_generator

VOCAB = 500


def _no_host_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("a device→host read inside the sampler")

    monkeypatch.setattr(torch.Tensor, "tolist", refuse)
    monkeypatch.setattr(torch.Tensor, "item", refuse)


def test_sample_leaves_ids_on_the_device_and_equals_the_host_list(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, seed=5),
        SamplingParams(temperature=1.0, top_k=20, seed=6),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.2, top_p=0.7, seed=7),
        SamplingParams(temperature=0.9, top_k=5, top_p=0.9, seed=8),
    ]
    expected = Sampler()(logits, params, [make_generator(p.seed) for p in params])
    with monkeypatch.context() as m:
        _no_host_reads(m)
        ids = Sampler().sample(logits, params, [make_generator(p.seed) for p in params])
    assert isinstance(ids, torch.Tensor) and ids.device == logits.device and ids.dtype == torch.int64
    assert ids.tolist() == expected


def test_all_greedy_sample_is_the_argmax_on_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(2))
    argmax = logits.argmax(-1)
    with monkeypatch.context() as m:
        _no_host_reads(m)
        ids = Sampler().sample(logits, [SamplingParams(temperature=0.0)] * 4, [None] * 4)
    assert torch.equal(ids, argmax)


def test_host_ids_copies_in_order() -> None:
    ids = torch.tensor([7, 0, 31999, 5])
    assert HostIds(torch.device("cpu")).fetch(ids) == [7, 0, 31999, 5]
    assert HostIds(torch.device("cpu")).fetch(ids[:0]) == []


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.9, top_p=0.9, seed=3, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
def test_a_step_reads_its_ids_back_once(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, params: SamplingParams
) -> None:
    """Every sampled step reads its ids back through one ``HostIds.start`` (the one transfer; ``wait`` only
    waits for it), and its tokens are that read."""
    llm = LLM(str(tiny_llama_dir), device="cpu", block_size=4, num_gpu_blocks=128)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    runner = llm.engine.runner
    fetched: list[list[int]] = []
    start, execute = runner.host_ids.start, runner.execute

    def counted_start(ids: torch.Tensor) -> None:
        fetched.append(ids.tolist())
        start(ids)

    def checked_execute(out: object) -> list[int | None]:
        start = len(fetched)
        sampled = execute(out)
        tokens = [tok for tok in sampled if tok is not None]
        assert len(fetched) - start == (1 if tokens else 0), fetched[start:]
        if tokens:  # the runner reorders [decodes | prefills]; the ids are the same multiset
            assert sorted(fetched[-1]) == sorted(tokens)
        return sampled

    monkeypatch.setattr(runner.host_ids, "start", counted_start)
    monkeypatch.setattr(runner, "execute", checked_execute)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert fetched
