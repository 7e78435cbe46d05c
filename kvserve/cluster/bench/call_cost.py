"""`kvserve bench call-cost`: the router's CPU per dispatch message to a worker, by channel.

The router hands a worker its requests by a Ray actor call (``add_requests``, awaited for its answer) and
sends everything else on the WorkerLink, one gRPC bidi stream per worker (docs/architecture.md, "Two
channels"). This measures what one such message costs the *sending* process's CPU, request and answer
included, with a dispatch-sized payload (one ``WorkerRequest`` of ``--prompt-tokens`` tokens):

* ``ray``: an async actor awaiting ``callee.add_requests.remote([request])`` ``--count`` times, one at a time
  (the router's common case: requests reach it spread out, so batches rarely form); CPU of that actor's
  process (all threads, ``kvserve/cluster/bench/proc_cpu.py``) over the calls;
* ``grpc``: a ``grpc.aio`` server (as the router's WorkerLink service) writing the same request as bytes
  (its ``OwnedRequest`` proto) on a bidi stream to a client process that answers each with a few bytes (as a
  ``CommandAck``), awaiting each answer; CPU of the server's process over the messages.

Medians of ``--runs``; the machine's other load inflates both alike. Needs Ray (the ``ray`` channel).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from kvserve.cluster.bench.proc_cpu import read_cpu

CHANNELS = ("ray", "grpc")
_METHOD = "/kvserve.bench.CallCost/Stream"


def _request(prompt_tokens: int):  # noqa: ANN202 - a WorkerRequest (imported lazily)
    from kvserve.workers.core.request import WorkerRequest
    from kvserve.workers.core.sampling_params import SamplingParams

    return WorkerRequest("req-0#bench.1", tuple(range(prompt_tokens)), SamplingParams(max_tokens=64, seed=1),
                         owner="127.0.0.1:1", owner_key="k" * 32)  # fmt: skip


def _as_bytes(prompt_tokens: int) -> bytes:
    from kvserve.protos.kvserve.v1 import worker_pb2 as pb
    from kvserve.workers.transport.request_table import sampling_proto

    r = _request(prompt_tokens)
    return pb.OwnedRequest(request_id=r.request_id, owner=r.owner, owner_key=r.owner_key, prompt_ids=r.prompt,
                           sampling=sampling_proto(r.params)).SerializeToString()  # fmt: skip


def ray_us_per_call(count: int, prompt_tokens: int) -> float:
    """Microseconds of the caller process's CPU per awaited actor call (a local Ray is started if none runs)."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)

    @ray.remote(num_cpus=0)
    class Callee:
        def add_requests(self, requests: list) -> None:
            return None

    @ray.remote(num_cpus=0)
    class Caller:
        def __init__(self, callee: object) -> None:
            self.callee = callee

        def pid(self) -> int:
            return os.getpid()

        async def run(self, n: int, requests: list) -> None:
            for _ in range(n):
                await self.callee.add_requests.remote(requests)  # type: ignore[attr-defined]

    callee = Callee.remote()
    caller = Caller.remote(callee)
    try:
        pid, requests = ray.get(caller.pid.remote()), [_request(prompt_tokens)]
        ray.get(caller.run.remote(20, requests))  # warm-up
        before = read_cpu(pid)
        ray.get(caller.run.remote(count, requests))
        return read_cpu(pid).seconds_since(before) / count * 1e6
    finally:
        ray.kill(caller)
        ray.kill(callee)


def grpc_us_per_message(count: int, prompt_tokens: int) -> float:
    """Microseconds of this process's CPU per message written and answer read, the peer a child process."""
    import grpc

    payload = _as_bytes(prompt_tokens)
    spent: list[float] = []

    async def stream(requests, context):  # noqa: ANN001, ANN202 - a generic handler's arguments
        answers = requests.__aiter__()
        for i in range(20 + count):
            if i == 20:
                spent.append(time.process_time())
            yield payload
            await answers.__anext__()
        spent.append(time.process_time())

    async def run() -> None:
        server = grpc.aio.server()
        handler = grpc.stream_stream_rpc_method_handler(stream)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("kvserve.bench.CallCost",
                                                                             {"Stream": handler}),))  # fmt: skip
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        root = str(Path(__file__).resolve().parents[3])
        child = subprocess.Popen([sys.executable, "-m", "kvserve.cluster.bench.call_cost", "--answer", str(port)],
                                 cwd=root)  # fmt: skip
        await asyncio.to_thread(child.wait)
        await server.stop(None)
        if child.returncode:
            raise RuntimeError(f"the answering process failed (rc={child.returncode})")

    asyncio.run(run())
    return (spent[1] - spent[0]) / count * 1e6


def _answer(port: int) -> None:
    """The peer of ``grpc``: read each message, answer with a few bytes, as a worker's link thread would."""
    import queue

    import grpc

    answers: queue.Queue[bytes | None] = queue.Queue()

    def answer_stream():  # noqa: ANN202 - the client's request stream: the answers
        while (item := answers.get()) is not None:
            yield item

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        for _ in channel.stream_stream(_METHOD)(answer_stream()):
            answers.put(b"\x08\x01")  # NOTE: a CommandAck's size
        answers.put(None)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--channels", default=",".join(CHANNELS), help=f"comma list of {', '.join(CHANNELS)}")
    p.add_argument("--count", type=int, default=500, help="messages per run")
    p.add_argument("--prompt-tokens", type=int, default=150, help="the dispatched request's prompt length")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", action="store_true")
    p.add_argument("--answer", type=int, help=argparse.SUPPRESS)  # the grpc peer's side


def run(args: argparse.Namespace) -> int:
    if args.answer is not None:
        _answer(args.answer)
        return 0
    measure = {"ray": ray_us_per_call, "grpc": grpc_us_per_message}
    out = {}
    for channel in (c.strip() for c in args.channels.split(",") if c.strip()):
        if channel not in measure:
            print(f"error: channels must be among {CHANNELS}", file=sys.stderr)
            return 2
        runs = [measure[channel](args.count, args.prompt_tokens) for _ in range(args.runs)]
        out[channel] = {"us_per_message": round(statistics.median(runs), 1), "runs": [round(r, 1) for r in runs]}
        if not args.json:
            print(f"{channel}: {out[channel]['us_per_message']:.1f} us of the sender's CPU per message "
                  f"(runs {out[channel]['runs']})", flush=True)  # fmt: skip
    if args.json:
        print(json.dumps({"count": args.count, "prompt_tokens": args.prompt_tokens, "channels": out}))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m kvserve.cluster.bench.call_cost")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
