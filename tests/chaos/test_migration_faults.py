"""A live migration that fails, against real workers (``kvserve serve``, tiny model, 2 CPU workers): the
router SIGKILLs or SIGSTOPs one side of a move at a phase boundary (the ``Mover.fault`` hook, armed
through Ray only, by tests/chaos/fault_router.py's router), and the move must end as
docs/architecture.md section 5 says: exactly one live copy of the request, the stream complete and
token-identical to an undisturbed run (greedy and seeded alike), no block leaked on any worker
(``wait_idle``: every pool empty and intact), the victim replaced by Ray.

The same invariant on every branch, with fake workers and time under control, is in
``tests/unit/test_migration_faults.py``; this checks that real processes dying or hanging keep it:

* the source killed once it exported (before the import): the destination's copy is the one (the exported
  state is owned by the router, which never reads it, so it outlives the source's process);
* the destination killed once it imported (before the commit): the request is replayed elsewhere;
* the destination hung (SIGSTOP) before the import: the import times out at the stall threshold,
  the paused source copy resumes, the hung worker is killed and replaced.
"""

from __future__ import annotations

import time

import grpc
import pytest

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from tests.chaos.conftest import ServedCluster
from tests.chaos.served import cluster_fixture
from tests.chaos.streams import Stream, prompt, request, run_all
from tests.chaos.test_failover import RESTART_TIMEOUT_S, _wait_status, _worker

MAX_TOKENS = 400  # long enough to be mid-stream when the move starts on a fast box
CASES = [  # (phase, action, side, which request: 0 greedy, 1 seeded)
    ("before_import", "kill", "src", 0),
    ("after_import", "kill", "dst", 1),
    ("before_import", "hang", "dst", 0),
]


cluster = cluster_fixture(fault_router=True)


def _requests() -> list[spb.GenerateRequest]:
    return [request(prompt(300), MAX_TOKENS, request_id="moved-greedy"),
            request(prompt(301), MAX_TOKENS, seed=4242, request_id="moved-seeded")]  # fmt: skip


@pytest.fixture(scope="module")
def reference(cluster: ServedCluster) -> list[Stream]:
    ref = run_all(cluster.address, _requests())
    assert all(s.code == grpc.StatusCode.OK and len(s.tokens) == MAX_TOKENS for s in ref), [
        (s.code, s.details) for s in ref
    ]
    cluster.wait_idle()
    return ref


@pytest.mark.parametrize(("phase", "action", "side", "kind"), CASES)
def test_a_failed_migration_leaves_one_copy_and_the_stream_token_identical(
    cluster: ServedCluster, reference: list[Stream], phase: str, action: str, side: str, kind: int
) -> None:
    c = cluster
    stream = Stream(c.address, _requests()[kind], timeout=240, first_tokens=3).start()
    assert stream.started.wait(120), "no first tokens"
    src = stream.worker_ids[-1]
    dst = next(w.worker_id for w in c.status().workers if w.worker_id != src)
    victim = src if side == "src" else dst
    restarts = _worker(c.status(), victim).restarts_total
    c.arm_migration_fault(phase, action, side)
    t0 = time.monotonic()
    moved = c.migrate(stream.req.request_id, dst)
    stream.wait(240)
    assert not (stream.ended_at is not None and stream.ended_at < t0), "the stream ended before the move began"
    assert stream.code == grpc.StatusCode.OK, (stream.code, stream.details)
    assert stream.tokens == reference[kind].tokens, "the stream differs from the undisturbed run"
    assert stream.final is not None and stream.final.usage.completion_tokens == MAX_TOKENS
    back = _wait_status(
        c, lambda st: _worker(st, victim).state == "up" and _worker(st, victim).healthy
        and _worker(st, victim).restarts_total > restarts, RESTART_TIMEOUT_S, f"{victim} replaced and back up",
    )  # fmt: skip
    c.wait_idle()  # every block free, every pool intact: no paused or orphaned copy left anywhere
    if (phase, side) == ("before_import", "src"):
        # The exported state is the router's (a return of its call), not the dead source's: the move completes.
        assert moved and stream.final.num_replays == 0, (moved, stream.final.num_replays)
    print(f"\nFIGURES migration fault {phase}/{action} {side} ({stream.req.request_id}): moved={moved}, "
          f"replays {stream.final.num_replays}, migrations {stream.final.num_migrations}, stream complete "
          f"{time.monotonic() - t0:.1f}s after the move began, workers {sorted(set(stream.worker_ids))}, "
          f"victim restarts {_worker(back, victim).restarts_total}")  # fmt: skip
