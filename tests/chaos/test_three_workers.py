"""Faults on one 3-worker ``kvserve serve`` (tiny model, CPU): two workers SIGKILLed at once.

* Two of three killed together: the streams of both continue on the third, token-identical
  (greedy and seeded); both come back (new incarnations) and serve.

WorkerLink partitions (the process alive and stepping, shorter and longer than ``--link-grace-s``)
are real ones, through a TCP relay: tests/chaos/test_partition.py.
Every test ends with the cluster idle: all blocks free, every pool's integrity intact.
"""

from __future__ import annotations

import os
import signal
import time

import grpc

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from tests.chaos.conftest import ServedCluster
from tests.chaos.served import cluster_fixture
from tests.chaos.streams import Stream, prompt, request, run_all
from tests.chaos.test_failover import RESTART_TIMEOUT_S, _held_at, _wait_status, _worker

NUM_WORKERS = 3
LINK_GRACE_S = 3.0  # above a reconnect on a loaded 1-core box, below the stall threshold (5 s)
MAX_TOKENS = 160


cluster = cluster_fixture("--link-grace-s", str(LINK_GRACE_S), num_workers=NUM_WORKERS)


def _requests(base: int, n: int) -> list[spb.GenerateRequest]:
    """Greedy and seeded, alternating in pairs (each worker gets both kinds under any round-robin)."""
    return [request(prompt(base + i), MAX_TOKENS, seed=2000 + base + i if i % 4 in (2, 3) else None)
            for i in range(n)]  # fmt: skip


def _reference(c: ServedCluster, reqs: list[spb.GenerateRequest]) -> list[Stream]:
    ref = run_all(c.address, reqs)
    assert all(s.code == grpc.StatusCode.OK and len(s.tokens) == MAX_TOKENS for s in ref), [
        (s.code, s.details) for s in ref
    ]
    c.wait_idle()
    return ref


def _start(c: ServedCluster, reqs: list[spb.GenerateRequest]) -> list[Stream]:
    streams = [Stream(c.address, r, first_tokens=3).start() for r in reqs]
    for s in streams:
        assert s.started.wait(120), "no first tokens"
    return streams


def _holders(streams: list[Stream]) -> dict[str, int]:
    held: dict[str, int] = {}
    for s in streams:
        held[s.last_worker] = held.get(s.last_worker, 0) + 1
    return held


def _check_identical(streams: list[Stream], reference: list[Stream]) -> None:
    for s, ref in zip(streams, reference, strict=True):
        assert s.code == grpc.StatusCode.OK, (s.req.request_id, s.code, s.details)
        assert s.tokens == ref.tokens, f"{s.req.token_ids.ids[:3]}...: differs from the undisturbed run"
        assert s.final is not None and s.final.usage.completion_tokens == MAX_TOKENS


def test_two_of_three_workers_killed_at_once_continue_on_the_third_and_both_return(cluster: ServedCluster) -> None:
    c = cluster
    reqs = _requests(0, 9)
    reference = _reference(c, reqs)
    before = {w.worker_id: w.restarts_total for w in c.status().workers}

    streams = _start(c, reqs)
    held = _holders(streams)
    victims = sorted(held, key=held.get, reverse=True)[:2]  # type: ignore[arg-type]
    assert len(victims) == 2 and all(held[v] for v in victims), f"streams on fewer than two workers: {held}"
    survivor = next(w for w in before if w not in victims)
    pids = [c.worker_pid(v) for v in victims]  # NOTE: asked first, so the two kills land together
    t_kill = time.monotonic()
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    _wait_status(c, lambda st: all(_worker(st, v).state != "up" or not _worker(st, v).healthy for v in victims),
                 30, "both victims out of placement")  # fmt: skip
    t_detect = time.monotonic() - t_kill
    for s in streams:
        s.wait(240)

    moved = [s for s in streams if _held_at(s, t_kill) in victims]
    assert moved and {_held_at(s, t_kill) for s in moved} == set(victims), "streams on both victims"
    assert {s.req.sampling.HasField("seed") for s in moved} == {True, False}, "greedy and seeded moved"
    _check_identical(streams, reference)
    # NOTE: at least one replay each: a replay of the first victim found down may land on the
    # second before the router knows it is dead too (then a second one), or on a victim that is
    # already back (a new incarnation).
    assert all(s.final.num_replays >= 1 for s in moved), [s.final.num_replays for s in moved if s.final]
    on_survivor = sum(survivor in s.worker_ids for s in moved)
    assert on_survivor, f"no stream of the victims continued on the survivor {survivor}"
    resumed = [s.resumed_after(t_kill, _held_at(s, t_kill)) for s in moved]
    assert all(r is not None for r in resumed)

    back = _wait_status(
        c, lambda st: all((w := _worker(st, v)).state == "up" and w.healthy and w.restarts_total > before[v]
                          for v in victims), RESTART_TIMEOUT_S, "both victims back up",
    )  # fmt: skip
    t_restart = time.monotonic() - t_kill
    after = run_all(c.address, [request(prompt(80 + i), 8) for i in range(6)])
    assert all(s.code == grpc.StatusCode.OK for s in after)
    served = {w for s in after for w in s.worker_ids}
    assert set(victims) <= served, f"the restarted workers got no request: {served}"
    c.wait_idle()
    identical = sum(s.tokens == r.tokens for s, r in zip(streams, reference, strict=True))
    print(f"\nFIGURES two of three killed: streams {len(streams)}, on the victims {len(moved)}, continued "
          f"{len(moved)} ({on_survivor} on the survivor; slowest {max(resumed):.2f}s after the kill; replays "
          f"{sorted(s.final.num_replays for s in moved)}), identical {identical}/{len(streams)}; "
          f"out of placement {t_detect:.2f}s; both back up {t_restart:.1f}s after the kill "
          f"(restarts {[_worker(back, v).restarts_total for v in victims]}); blocks leaked 0")  # fmt: skip
