"""A worker without a router aborts its requests after ``orphan_timeout_s`` (their clients' streams
ended with the router) and frees every block; the abort is in its outbox for a router to come."""

from __future__ import annotations

import socket
import time
from pathlib import Path

from kvserve.workers.core.request import WorkerRequest
from kvserve.workers.core.sampling_params import SamplingParams
from kvserve.workers.engine.config import EngineConfig
from kvserve.workers.transport.options import WorkerOptions
from kvserve.workers.transport.worker import WorkerCore
from tests.integration.worker_harness import unbundle

ORPHAN_TIMEOUT_S = 0.5


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens there once the socket is closed


def test_orphaned_requests_are_aborted_and_their_blocks_freed(tiny_llama_dir: Path) -> None:
    options = WorkerOptions(router_address=f"127.0.0.1:{_closed_port()}", orphan_timeout_s=ORPHAN_TIMEOUT_S)
    core = WorkerCore("w-orphan", EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=32), options)
    core.start()
    try:
        t0 = time.monotonic()
        params = SamplingParams(max_tokens=400, ignore_eos=True)
        core.add_request(WorkerRequest("orphan-1", (5, 6, 7, 8, 9), params))
        core.add_request(WorkerRequest("orphan-2", (9, 8, 7, 6, 5), params))
        # NOTE: bounded wait on the worker's own state (its stats snapshot), no fixed sleep.
        deadline = time.monotonic() + 60
        while (s := core.stats()).num_running + s.num_waiting > 0 or s.used_blocks > 0:
            assert time.monotonic() < deadline, f"orphans still held after 60 s: {s}"
            time.sleep(0.05)
        assert time.monotonic() - t0 >= ORPHAN_TIMEOUT_S
        core._call(core.engine.check_integrity)
        with core.outbox._cond:
            pending = [p.step_outputs for m in core.outbox._log for p in unbundle(m) if p.HasField("step_outputs")]
        aborted = {o.request_id for m in pending for o in m.outputs if o.finish_reason == "abort"}
        assert aborted == {"orphan-1", "orphan-2"}
    finally:
        core.stop()
