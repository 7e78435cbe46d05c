"""A tensor-parallel group never runs with a missing rank: a rank SIGKILLed mid-stream makes rank 0's
next step raise (gloo: the peer's connection closed) instead of hanging or producing tokens without it.
The worker's engine thread then dies and the router's liveness rule restarts the whole worker
(kvserve/workers/transport/worker.py, kvserve/router/table/liveness.py)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from kvserve.workers.core.request import WorkerRequest
from kvserve.workers.core.sampling_params import SamplingParams
from kvserve.workers.engine.engine import LLM


def test_killed_rank_fails_the_group_step(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), device="cpu", num_gpu_blocks=64, tensor_parallel_size=2)
    engine = llm.engine
    try:
        engine.add_request(WorkerRequest("r", [1, 2, 3, 4], SamplingParams(max_tokens=50, ignore_eos=True)))
        for _ in range(3):
            assert engine.step()  # the group streams
        (follower,) = engine._ranks.processes
        os.kill(follower.pid, signal.SIGKILL)
        follower.wait()
        assert not engine.followers_alive()
        with pytest.raises(RuntimeError):
            for _ in range(50):  # the first collective after the kill fails
                engine.step()
    finally:
        engine.close()


_RANK0 = """
import sys
from kvserve.workers.core.request import WorkerRequest
from kvserve.workers.core.sampling_params import SamplingParams
from kvserve.workers.engine.engine import LLM
llm = LLM(sys.argv[1], device="cpu", num_gpu_blocks=64, tensor_parallel_size=2)
llm.engine.add_request(WorkerRequest("r", [1, 2, 3], SamplingParams(max_tokens=10, ignore_eos=True)))
llm.engine.step()
print(llm.engine._ranks.processes[0].pid, flush=True)
sys.stdin.read()  # holds the group until killed
"""


def test_ranks_exit_when_rank0_dies(tiny_llama_dir: Path) -> None:
    """SIGKILL rank 0 (no STOP sent): the other rank's blocked collective fails and its process ends."""
    import subprocess
    import sys

    import psutil

    rank0 = subprocess.Popen([sys.executable, "-c", _RANK0, str(tiny_llama_dir)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert rank0.stdout is not None
        follower = psutil.Process(int(rank0.stdout.readline()))
        rank0.kill()
        rank0.wait()
        follower.wait(timeout=120)  # raises psutil.TimeoutExpired if it outlives its group
    finally:
        rank0.kill()
