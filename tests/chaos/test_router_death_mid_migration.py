"""The router SIGKILLed in the middle of a live migration of a stream a frontend owns (real processes: ``kvserve serve``
with one frontend, tiny model, 2 CPU workers; the kill at the ``after_import`` boundary, by the router itself through
tests/chaos/fault_router.py): the import landed, the source's copy is paused and nobody is left to free it.

The destination streams on to the frontend while serve restarts the router; the new router adopts the running copy
from the destination's table and frees the paused one it finds in the source's (kvserve/router/requests/exported.py).
The stream completes token-identical to an undisturbed run, and no block is left held on any worker.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.chaos.conftest import ServedCluster, serve_cluster, stop_cluster
from tests.chaos.streams import Stream, prompt, request, run_all
from tests.chaos.test_frontends import FRONTEND_LINE
from tests.chaos.test_router_death import ROUTER_RESTARTED

MAX_TOKENS = 600  # long enough to be mid-stream when the move starts, and after the router is back


@pytest.fixture(scope="module")
def fronted(tiny_llama_dir: Path) -> Iterator[tuple[ServedCluster, str]]:
    c = serve_cluster(tiny_llama_dir, "--frontends", "1", "--frontend-port", "0", fault_router=True)
    try:
        yield c, c.proc.wait_for_line(FRONTEND_LINE, timeout=120).group(2)
    finally:
        stop_cluster(c)


def test_a_router_killed_mid_migration_leaves_one_copy_and_the_stream_whole(
    fronted: tuple[ServedCluster, str],
) -> None:
    c, frontend = fronted
    req = request(prompt(900), MAX_TOKENS, request_id="moved-owned")
    (reference,) = run_all(c.address, [req])
    assert reference.code == grpc.StatusCode.OK and len(reference.tokens) == MAX_TOKENS
    c.wait_idle()
    stream = Stream(frontend, req, timeout=240, first_tokens=3).start()
    assert stream.started.wait(120), "no first tokens"
    (key,) = c.owned_keys()
    src = stream.worker_ids[-1]
    dst = next(w.worker_id for w in c.status().workers if w.worker_id != src)
    c.arm_migration_fault("after_import", "kill", "router")
    t0 = time.monotonic()
    with pytest.raises(AssertionError):  # NOTE: the router died inside the call
        c.migrate(key, dst)
    stream.wait(240)
    assert stream.code == grpc.StatusCode.OK, (stream.code, stream.details)
    assert stream.tokens == reference.tokens, "the stream differs from the undisturbed run"
    assert stream.ended_at is not None and stream.ended_at > t0, "the stream ended before the move began"
    assert dst in stream.worker_ids[stream.worker_ids.index(src) :], "the import never streamed: nothing was tested"
    c.proc.wait_for_line(ROUTER_RESTARTED, timeout=240)
    c.wait_idle(timeout=120)  # NOTE: the paused copy on the source would hold its blocks for ever
    print(f"\nFIGURES router killed after the import of {key}: stream complete token-identical "
          f"{time.monotonic() - t0:.1f}s after the move began; workers {sorted(set(stream.worker_ids))}; "
          "0 blocks left held")
