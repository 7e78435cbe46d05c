"""The router's streaming path in one process, without gRPC or Ray: what it costs in Python per token.

``python -m kvserve.cluster.bench.stream_path [--streams 256] [--workers 2] [--steps 200] [--repeats 5]``

A real ``Router`` with stand-in worker handles (their Ray calls resolve at once) places ``--streams``
requests on one multiplexed stream (kvserve/router/requests/mux.py, as ``GenerateStream`` does), then each worker's
step messages, serialized as its WorkerLink would send them (one ``StepMessages`` with one output
per request, one token each), are parsed and handed to ``Router.on_message``; the stream's batch is
taken and serialized after every worker step. Timed: this thread's CPU time over all steps, per
streamed token (parse + demux + mux + batch serialization). Medians and the minimum over
``--repeats`` fresh routers.

NOTE: the whole cluster pays more per token than this (``kvserve bench data-plane``: grpc.aio's
receive and send paths, the loop's wake-ups, and on a VM the cost of waking an idle vCPU); this is
the part the router's own code decides, measured without that noise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

from kvserve.cluster.bench.data_plane import bench_router_config
from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.router.requests.mux import StreamMux
from kvserve.router.requests.router import Router
from kvserve.router.table.worker_link import _Session
from kvserve.workers.core.identity import WorkerIdentity
from kvserve.workers.core.step_columns import append_entry


class _Call:
    def remote(self, *args: Any, **kwargs: Any) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut


class _Handle:
    """A worker actor handle whose every method call succeeds at once."""

    def __getattr__(self, name: str) -> _Call:
        return _Call()


async def _one(streams: int, workers: int, steps: int) -> float:
    router = Router(bench_router_config(streams))
    for i in range(workers):
        w = f"worker-{i}"
        router.add_worker(w, _Handle(), WorkerIdentity(w, "m", 16, 1 << 16, 1 << 16, 32000))
        router.link.sessions.setdefault(w, _Session()).queue = asyncio.Queue()
        router.on_hello(w, pb.Hello(worker_id=w, total_blocks=1 << 16, incarnation="sim"), False)
    mux = StreamMux(columns=True)  # NOTE: as a frontend's stream (kvserve/frontend/link.py)
    sampling = spb.SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    prompt = spb.TokenIds(ids=list(range(1, 17)))
    requests = [
        router.submit(spb.GenerateRequest(request_id=f"r{i}", token_ids=prompt, sampling=sampling), None, mux)
        for i in range(streams)
    ]
    while any(r.worker_id is None for r in requests):
        await asyncio.sleep(0)  # NOTE: the dispatches resolve on the loop
    on: dict[str, list[str]] = {}
    for r in requests:
        on.setdefault(r.worker_id or "", []).append(r.worker_rid)
    stamp = f"{time.monotonic_ns()};"  # what the simulated workers put in text_delta
    wire = [(w, _step_message(step, rids, stamp)) for step in range(1, steps + 1) for w, rids in on.items()]
    streamed = 0
    began = time.thread_time()
    for w, raw in wire:
        router.on_message(w, pb.WorkerMessage.FromString(raw))
        batch = mux.take()
        batch.SerializeToString()
        streamed += len(batch.columns.token_ids) + sum(len(resp.token_ids) for resp in batch.responses)
    spent = time.thread_time() - began
    if streamed != streams * steps:  # NOTE: a path that dropped tokens would look fast
        raise RuntimeError(f"streamed {streamed} tokens, expected {streams * steps}")
    return spent / streamed * 1e6


def _step_message(step: int, worker_rids: list[str], stamp: str) -> bytes:
    """One worker step on the wire: one token for each of ``worker_rids``, plain (as columns)."""
    step_outputs = pb.StepOutputs(decode_step=step)
    for rid in worker_rids:
        append_entry(step_outputs.columns, rid, [step], step, stamp)
    step_messages = pb.StepMessages(outputs=step_outputs)
    return pb.WorkerMessage(seq=step, step=step_messages).SerializeToString()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    runs = [asyncio.run(_one(args.streams, args.workers, args.steps)) for _ in range(args.repeats)]
    result = {"streams": args.streams, "workers": args.workers, "steps": args.steps,
              "router_python_us_per_token_median": statistics.median(runs),
              "router_python_us_per_token_min": min(runs), "runs": runs}  # fmt: skip
    if args.json:
        print(json.dumps(result))
    else:
        print(f"router streaming path, in process: {result['router_python_us_per_token_median']:.2f} µs/token "
              f"median (min {min(runs):.2f}) over {args.repeats} runs; {args.streams} streams, {args.workers} "
              f"workers, {args.steps} steps")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
