"""A take-over on the worker (docs/architecture.md 2a "Resuming through another frontend";
kvserve/workers/transport/reown.py): the router's ``Reown`` re-points an owned request to a new owner, which first
gets its whole output so far (tokens from token 0, all text so far) and then every later output, token-identical
to an undisturbed run; a request that finished while its owner was unreachable is resent once; an unknown one is
acked ok=false. Real WorkerCore on the tiny model, real gRPC on 127.0.0.1, no Ray (as test_worker_data_links.py).
"""

from __future__ import annotations

from collections.abc import Callable

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.workers.core.request import WorkerRequest
from kvserve.workers.core.sampling_params import SamplingParams
from kvserve.workers.transport.worker import WorkerCore
from tests.integration.worker_harness import RecordingRouter
from tests.unit import test_worker_data_links as data_links
from tests.unit.test_worker_data_links import PROMPT, _closed_address, _owned, _wait

# NOTE: the data-link tests' fixtures (a recording router, owners, WorkerCores on the tiny model)
router, owner, other_owner = data_links.router, data_links.owner, data_links.other_owner
make_core = data_links.make_core

PARAMS = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)


def _reown(rid: str, to: RecordingRouter, key: str) -> pb.RouterCommand:
    return pb.RouterCommand(reown=pb.Reown(request_id=rid, owner=spb.Owner(address=to.address, key=key)))


def _ack(r: RecordingRouter, worker_id: str, seq: int) -> pb.CommandAck:
    return r.wait_for(lambda: next((a for a in r.acks(worker_id) if a.command_seq == seq), None), what=f"ack {seq}")


def test_a_reowned_request_resends_its_output_to_the_new_owner_and_streams_on_there_token_identical(
    router: RecordingRouter, owner: RecordingRouter, other_owner: RecordingRouter,
    make_core: Callable[..., WorkerCore],
) -> None:  # fmt: skip
    core = make_core("w-reown", router.address)
    core.add_request(WorkerRequest("ref#0", PROMPT, PARAMS))
    router.wait_finished(["ref#0"], timeout=120)
    reference = router.tokens("ref#0")
    ref_text = "".join(o.text_delta for o in router.outputs("ref#0"))
    core.add_request(_owned("r#1", "k1", owner, PARAMS))
    owner.wait_tokens("k1#1", 5)
    seq = router.send("w-reown", _reown("r#1", other_owner, "k2"))
    assert _ack(router, "w-reown", seq).ok
    other_owner.wait_finished(["k2#1"], timeout=120)
    outs = other_owner.outputs("k2#1")
    first = outs[0]
    assert len(first.new_token_ids) == first.num_output_tokens >= 5, "the catch-up starts at token 0"
    assert outs[-1].num_prompt_tokens == len(PROMPT), "the final output tells the new owner the prompt's length"
    assert other_owner.tokens("k2#1") == reference, "catch-up + the rest: the undisturbed run's tokens, once each"
    assert "".join(o.text_delta for o in outs) == ref_text
    before = owner.tokens("k1#1")
    assert before == reference[: len(before)] and not owner.finish_reason("k1#1"), "the old owner got no more"
    router.wait_finished(["r#1"])  # the router's progress goes on as before
    assert router.outputs("r#1")[-1].finish_reason == "length"
    seq = router.send("w-reown", _reown("nobody#1", other_owner, "k3"))
    assert not _ack(router, "w-reown", seq).ok


def test_a_request_finished_while_its_owner_was_unreachable_is_resent_once(
    router: RecordingRouter, other_owner: RecordingRouter, make_core: Callable[..., WorkerCore]
) -> None:
    core = make_core("w-unread", router.address)
    core.add_request(WorkerRequest("ref#0", PROMPT, SHORT))
    router.wait_finished(["ref#0"], timeout=60)
    core.add_request(WorkerRequest("gone#2", PROMPT, SHORT, owner=_closed_address(), owner_key="k"))
    router.wait_finished(["gone#2"], timeout=60)
    assert router.finish_reason("gone#2") == "length"
    seq = router.send("w-unread", _reown("gone#2", other_owner, "k9"))
    assert _ack(router, "w-unread", seq).ok
    other_owner.wait_finished(["k9#2"])
    (out,) = other_owner.outputs("k9#2")
    assert list(out.new_token_ids) == router.tokens("ref#0") and out.finish_reason == "length"
    assert out.text_delta == "".join(o.text_delta for o in router.outputs("ref#0"))
    seq = router.send("w-unread", _reown("gone#2", other_owner, "k10"))
    assert not _ack(router, "w-unread", seq).ok, "one take-over uses it up"
    assert _wait(lambda: len(core._call(lambda: core._finished_owned)) == 0, what="nothing kept")


LOGPROBS = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True, logprobs=2)


def _logprobs(r: RecordingRouter, rid: str) -> list[dict[int, float]]:
    return [dict(lp.logprobs) for o in r.outputs(rid) for lp in o.logprobs]


def test_a_reowned_request_with_logprobs_resends_them_with_its_tokens(
    router: RecordingRouter, owner: RecordingRouter, other_owner: RecordingRouter,
    make_core: Callable[..., WorkerCore],
) -> None:  # fmt: skip
    """Its catch-up carries every token's logprobs so far; after a migration too (the worker keeps an owned
    request's logprobs and the migration carries them), so catch-up + the rest == the undisturbed run's."""
    src, dst = make_core("w-lp-src", router.address), make_core("w-lp-dst", router.address)
    src.add_request(WorkerRequest("ref#0", PROMPT, LOGPROBS))
    router.wait_finished(["ref#0"], timeout=120)
    reference, ref_logprobs = router.tokens("ref#0"), _logprobs(router, "ref#0")
    assert len(ref_logprobs) == len(reference) == 200
    src.add_request(_owned("lp#1", "k1", owner, LOGPROBS))
    owner.wait_tokens("k1#1", 5)
    state = src.export_request("lp#1")
    # NOTE: every token the worker output so far (its owner may not have read the last ones yet)
    assert state is not None and len(state.logprobs) == len(state.output_token_ids) >= 5
    assert dst.import_request(state) and src.finish_export("lp#1", migrated=True)
    owner.wait_tokens("k1#1", len(state.logprobs) + 5)
    seq = router.send("w-lp-dst", _reown("lp#1", other_owner, "k2"))
    assert _ack(router, "w-lp-dst", seq).ok
    other_owner.wait_finished(["k2#1"], timeout=120)
    first = other_owner.outputs("k2#1")[0]
    assert len(first.logprobs) == len(first.new_token_ids) > len(state.logprobs), "every token's, from token 0"
    assert other_owner.tokens("k2#1") == reference
    assert _logprobs(other_owner, "k2#1") == ref_logprobs


def test_a_replayed_request_with_logprobs_is_not_taken_over_and_streams_on_to_its_owner(
    router: RecordingRouter, owner: RecordingRouter, other_owner: RecordingRouter,
    make_core: Callable[..., WorkerCore],
) -> None:  # fmt: skip
    """A replay (``resume_output_ids``) began it after tokens whose logprobs this worker never had: no catch-up
    could carry them, so the take-over is refused (ok=False: the client hears NOT_FOUND) and nothing moves."""
    core = make_core("w-lp-replay", router.address)
    core.add_request(_owned("rp#1", "k1", owner, LOGPROBS, resume_output_ids=(7, 8, 9)))
    owner.wait_tokens("k1#1", 3)
    seq = router.send("w-lp-replay", _reown("rp#1", other_owner, "k2"))
    assert not _ack(router, "w-lp-replay", seq).ok
    n = len(owner.tokens("k1#1"))
    owner.wait_tokens("k1#1", n + 3)  # it streams on to its owner
    assert not other_owner.outputs("k2#1")
    assert core.abort("rp#1")
