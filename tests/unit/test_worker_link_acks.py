"""The router acks a worker's messages ``ack_every`` messages or ``ack_interval_s`` after the first unacked one
(kvserve/router/table/worker_link.py), and sends nothing over an idle link: the ack is a timer armed by a message,
not a wait that times out every interval (issue 41: the timeouts were ~3 ms of router CPU a second at idle).

Real gRPC over 127.0.0.1: the real ``WorkerLinkService`` (the recording router) and a real ``WorkerLinkClient``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.workers.core.identity import WorkerIdentity
from kvserve.workers.transport.outbox import Outbox
from kvserve.workers.transport.worker_link import WorkerLinkClient
from tests.integration.worker_harness import RecordingRouter
from tests.unit.test_worker_data_links import _wait

ACK_INTERVAL_S = 0.3


@pytest.fixture
def link() -> Iterator[tuple[RecordingRouter, Outbox, list[pb.RouterCommand]]]:
    router = RecordingRouter(ack_every=1000, ack_interval_s=ACK_INTERVAL_S).start()
    outbox = Outbox()
    received: list[pb.RouterCommand] = []
    identity = WorkerIdentity("w", "m", block_size=16, total_blocks=8, max_model_len=64, vocab_size=100)
    client = WorkerLinkClient(router.address, outbox, hello=lambda: identity.to_hello("inc-1"),
                              on_connect=lambda: None, on_command=received.append)  # fmt: skip
    client.start()
    try:
        _wait(lambda: client.connected, what="the link")
        yield router, outbox, received
    finally:
        client.stop()
        router.close()


def _events(first_seq: int, n: int) -> list[pb.WorkerMessage]:
    cleared = pb.AllBlocksCleared()
    return [pb.WorkerMessage(block_events=pb.BlockEvents(events=[pb.BlockEvent(seq=first_seq + i, cleared=cleared)]))
            for i in range(n)]  # fmt: skip


def _count_waits(router: RecordingRouter, worker_id: str) -> list[int]:
    """Count the link's waits for its next command from now on (each wakeup of its send loop waits again)."""
    waits = [0]

    async def patch() -> None:
        queue = router.service.sessions[worker_id].queue
        get = queue.get

        def counted():  # noqa: ANN202 - asyncio.Queue.get's coroutine
            waits[0] += 1
            return get()

        queue.get = counted

    router._run(patch())
    return waits


def test_a_few_messages_are_acked_within_the_interval_and_an_idle_link_gets_nothing(link) -> None:
    router, outbox, _ = link
    for msg in _events(1, 3):
        outbox.put(msg)
    t0 = time.monotonic()
    _wait(lambda: outbox.pending() == 0, 10, "the ack of 3 messages (below ack_every)")
    assert time.monotonic() - t0 < ACK_INTERVAL_S + 2.0
    sent0 = router.service.sessions["w"].acked_seq
    assert sent0 == outbox.last_seq
    # Idle: no message, so no ack is due and none is sent, and the link's send loop does not even wake up.
    waits = _count_waits(router, "w")
    time.sleep(3 * ACK_INTERVAL_S)
    assert router.service.sessions["w"].acked_seq == sent0
    assert waits[0] == 0, f"an idle link woke {waits[0]} times"
    for msg in _events(4, 2):
        outbox.put(msg)
    _wait(lambda: outbox.pending() == 0, 10, "the ack of the next messages")


def test_ack_every_acks_at_once(link) -> None:
    router, outbox, _ = link
    router.set_ack_policy(ack_every=4, ack_interval_s=3600.0)
    time.sleep(2 * ACK_INTERVAL_S)  # NOTE: a timer armed under the old interval has fired by now
    for msg in _events(1, 4):
        outbox.put(msg)
    _wait(lambda: outbox.pending() == 0, 10, "the ack after ack_every messages")
