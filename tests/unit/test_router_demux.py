"""Router demux of worker outputs: ordering across a migration, replays, cancellation."""

from __future__ import annotations

from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.router.config import RouterConfig
from kvserve.router.requests.router import Router, RouterRequest
from kvserve.workers.core.identity import WorkerIdentity
from kvserve.workers.core.sampling_params import SamplingParams


def _identity(worker_id: str) -> WorkerIdentity:
    return WorkerIdentity(worker_id, "m", block_size=16, total_blocks=8, max_model_len=64, vocab_size=100)


def _router() -> tuple[Router, RouterRequest]:
    router = Router(RouterConfig(port=0))
    router.add_worker("a", None, _identity("a"))
    router.add_worker("b", None, _identity("b"))
    r = RouterRequest("r", [1, 2, 3], SamplingParams(max_tokens=8), 0, "", (), 1, worker_id="a", worker_rid="r")
    r.dispatch_workers = {"a", "b"}  # on a, migrating to b (the Mover adds b from the import on)
    router.requests["r"] = r
    router.dispatcher.by_worker_rid["r"] = r  # outputs name the dispatch's worker-side id
    return router, r


def _out(tokens: list[int], total: int, finish: str = "") -> pb.RequestOutput:
    return pb.RequestOutput(request_id="r", new_token_ids=tokens, num_output_tokens=total, finish_reason=finish)


def _delivered(r: RouterRequest) -> list[int]:
    out: list[int] = []
    while not r.responses.empty():
        out.extend(r.responses.get_nowait().token_ids)
    return out


def test_destination_overtaking_source_is_held_until_the_gap_closes() -> None:
    router, r = _router()
    router._on_output("a", _out([10], 1))
    router._on_output("a", _out([11], 2))
    # Migrated after 3 tokens: b's first token (the 4th) arrives before a's 3rd.
    router._on_output("b", _out([13], 4))
    assert _delivered(r) == [10, 11]
    router._on_output("a", _out([12], 3))
    router._on_output("b", _out([14], 5, finish="length"))
    assert _delivered(r) == [12, 13, 14]
    assert r.finished and r.tokens_received == 5


def test_replayed_outputs_are_dropped() -> None:
    router, r = _router()
    router._on_output("a", _out([10], 1))
    router._on_output("a", _out([10], 1))  # a resend after a reconnect
    router._on_output("a", _out([11], 2))
    assert _delivered(r) == [10, 11]


def test_final_output_carries_usage_and_counts() -> None:
    router, r = _router()
    router._on_output("a", _out([10], 1))
    router._on_output("a", pb.RequestOutput(
        request_id="r", new_token_ids=[11], num_output_tokens=2, finish_reason="stop", num_cached_tokens=16,
        num_preemptions=2, num_swaps=1,
    ))  # fmt: skip
    responses = []
    while not r.responses.empty():
        responses.append(r.responses.get_nowait())
    final = responses[-1]
    assert final.finish_reason == "stop"
    assert (final.usage.prompt_tokens, final.usage.cached_tokens, final.usage.completion_tokens) == (3, 16, 2)
    assert (final.num_preemptions, final.num_swaps) == (2, 1)
    assert "r" not in router.requests
