"""`kvserve bench hop-latency`: what one process-to-process hop costs on this machine, by transport.

A streamed token crosses at least two processes between the engine step that made it and the client
(worker -> router or frontend -> client), so the machine's cost of one hop bounds the data plane's added
inter-token latency (issue 22's "p99 added ITL <= 2 ms") from below, whatever the design. This measures
it: a sender process stamps ``time.monotonic_ns()`` into a message every ``--gap-ms`` (so the receiver is
idle in between, as between engine steps) and the receiver takes arrival minus stamp, over each
transport the token path could use:

* ``pipe``: a blocking ``read`` on a pipe (the kernel's wake-up alone);
* ``tcp``: a blocking ``recv`` on a loopback TCP socket (plus the loopback network stack);
* ``tcp-asyncio``: the same socket read by an asyncio stream (plus an event loop's turns);
* ``grpc-sync``: a synchronous gRPC client streaming from a generator thread into a ``grpc.aio`` server,
  kvserve's ``WorkerLink.Connect`` (how a worker's outputs reach the router);
* ``grpc-aio``: a ``grpc.aio`` client writing into the same server (how a router, a frontend or a Python
  client's stream is read).

Report: p50 / p90 / p99 / max per transport in ms (``--json``: one object). Linux or macOS; no Ray, no
torch. Run it on a quiet machine: it measures the machine, not kvserve.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

TRANSPORTS = ("pipe", "tcp", "tcp-asyncio", "grpc-sync", "grpc-aio")
WARMUP = 10  # first messages dropped: connection set-up, first-call allocations
_STAMP = struct.Struct("<q")


def percentiles(latencies_ms: list[float]) -> dict[str, float]:
    """p50 / p90 / p99 / max of the samples (nearest rank)."""
    if not latencies_ms:
        raise ValueError("no samples")
    v = sorted(latencies_ms)

    def at(q: float) -> float:
        return v[min(len(v) - 1, int(q * len(v)))]

    return {"p50_ms": at(0.50), "p90_ms": at(0.90), "p99_ms": at(0.99), "max_ms": v[-1], "samples": len(v)}


def _since(stamp_ns: int) -> float:
    return (time.monotonic_ns() - stamp_ns) / 1e6


# ---- the sender (a child process: `python -m kvserve.cluster.bench.hop_latency --send ...`) ------------------------
def _send(transport: str, where: str, count: int, gap_s: float) -> None:
    """Send ``count`` stamped messages, one every ``gap_s``, to ``where`` (a pipe fd or a port)."""
    if transport == "pipe":
        fd = int(where)
        for _ in range(count):
            time.sleep(gap_s)
            os.write(fd, _STAMP.pack(time.monotonic_ns()))
        return
    if transport.startswith("tcp"):
        with socket.create_connection(("127.0.0.1", int(where))) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(count):
                time.sleep(gap_s)
                s.sendall(_STAMP.pack(time.monotonic_ns()))
        return
    import grpc

    from kvserve.protos.kvserve.v1 import worker_pb2 as pb
    from kvserve.protos.kvserve.v1 import worker_pb2_grpc as rpc

    def message() -> pb.WorkerMessage:  # NOTE: the stamp rides in seq; any small message costs the same
        return pb.WorkerMessage(seq=time.monotonic_ns(), heartbeat=pb.StepHeartbeat())

    if transport == "grpc-sync":
        with grpc.insecure_channel(f"127.0.0.1:{where}") as channel:

            def stream():
                for _ in range(count):
                    time.sleep(gap_s)
                    yield message()

            for _ in rpc.WorkerLinkStub(channel).Connect(stream()):
                pass
        return

    async def run() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{where}") as channel:
            call = rpc.WorkerLinkStub(channel).Connect()
            for _ in range(count):
                await asyncio.sleep(gap_s)
                await call.write(message())
            await call.done_writing()
            async for _ in call:
                pass

    asyncio.run(run())


# ---- the receiver (this process) ------------------------------------------------------------------------
def _spawn(transport: str, where: str, count: int, gap_s: float, pass_fds: tuple[int, ...] = ()) -> subprocess.Popen:
    argv = [sys.executable, "-m", "kvserve.cluster.bench.hop_latency", "--send", transport, "--to", where,
            "--count", str(count), "--gap-ms", str(gap_s * 1e3)]  # fmt: skip
    root = str(Path(__file__).resolve().parents[3])
    return subprocess.Popen(argv, cwd=root, pass_fds=pass_fds)


def _pipe(count: int, gap_s: float) -> list[float]:
    r, w = os.pipe()
    child = _spawn("pipe", str(w), count, gap_s, pass_fds=(w,))
    os.close(w)
    out, buf = [], b""
    while len(out) < count:
        chunk = os.read(r, _STAMP.size - len(buf))
        if not chunk:
            break
        buf += chunk
        if len(buf) == _STAMP.size:
            out.append(_since(_STAMP.unpack(buf)[0]))
            buf = b""
    os.close(r)
    child.wait()
    return out


def _tcp(count: int, gap_s: float) -> list[float]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        child = _spawn("tcp", str(server.getsockname()[1]), count, gap_s)
        conn, _ = server.accept()
        out = []
        with conn:
            for _ in range(count):
                data = conn.recv(_STAMP.size, socket.MSG_WAITALL)
                if len(data) < _STAMP.size:
                    break
                out.append(_since(_STAMP.unpack(data)[0]))
    child.wait()
    return out


def _tcp_asyncio(count: int, gap_s: float) -> list[float]:
    async def run() -> list[float]:
        out: list[float] = []
        done = asyncio.Event()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while len(out) < count:
                    out.append(_since(_STAMP.unpack(await reader.readexactly(_STAMP.size))[0]))
            except asyncio.IncompleteReadError:
                pass
            writer.close()
            done.set()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        child = _spawn("tcp-asyncio", str(server.sockets[0].getsockname()[1]), count, gap_s)
        await done.wait()
        server.close()
        await asyncio.to_thread(child.wait)
        return out

    return asyncio.run(run())


def _grpc(transport: str, count: int, gap_s: float) -> list[float]:
    import grpc

    from kvserve.protos.kvserve.v1 import worker_pb2_grpc as rpc

    out: list[float] = []

    class Receiver(rpc.WorkerLinkServicer):
        async def Connect(self, request_iterator, context):  # noqa: N802 - the generated method's name
            async for msg in request_iterator:
                out.append(_since(msg.seq))
            return
            yield  # an async generator: the response stream, closed with nothing sent

    async def run() -> None:
        server = grpc.aio.server()
        rpc.add_WorkerLinkServicer_to_server(Receiver(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        child = _spawn(transport, str(port), count, gap_s)
        await asyncio.to_thread(child.wait)
        await server.stop(None)

    asyncio.run(run())
    return out


RECEIVERS: dict[str, Callable[[int, float], list[float]]] = {
    "pipe": _pipe,
    "tcp": _tcp,
    "tcp-asyncio": _tcp_asyncio,
    "grpc-sync": lambda count, gap_s: _grpc("grpc-sync", count, gap_s),
    "grpc-aio": lambda count, gap_s: _grpc("grpc-aio", count, gap_s),
}


def measure(transport: str, count: int, gap_ms: float) -> dict[str, float]:
    """One transport's percentiles over ``count`` messages (the first ``WARMUP`` dropped).

    Raises:
        RuntimeError: the sender delivered fewer messages than asked.
    """
    got = RECEIVERS[transport](count + WARMUP, gap_ms / 1e3)
    if len(got) < count + WARMUP:
        raise RuntimeError(f"{transport}: {len(got)} of {count + WARMUP} messages arrived")
    return percentiles(got[WARMUP:])


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``kvserve bench hop-latency``."""
    p.add_argument("--transports", default=",".join(TRANSPORTS), help=f"comma list of {', '.join(TRANSPORTS)}")
    p.add_argument("--count", type=int, default=500, help="messages per transport (default: 500)")
    p.add_argument("--gap-ms", type=float, default=20.0, help="between messages: an engine step (default: 20)")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.add_argument("--send", choices=TRANSPORTS, help=argparse.SUPPRESS)  # the sender child's side
    p.add_argument("--to", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    """Measure each transport in turn; print a table (or JSON). 0 ok, 2 usage."""
    if args.send:
        _send(args.send, args.to, args.count, args.gap_ms / 1e3)
        return 0
    chosen = [t.strip() for t in args.transports.split(",") if t.strip()]
    unknown = [t for t in chosen if t not in TRANSPORTS]
    if unknown or args.count <= 0 or args.gap_ms < 0:
        print(f"error: transports must be among {TRANSPORTS} (got {unknown}), --count > 0, --gap-ms >= 0",
              file=sys.stderr)  # fmt: skip
        return 2
    results = {t: measure(t, args.count, args.gap_ms) for t in chosen}
    if args.json:
        print(json.dumps({"count": args.count, "gap_ms": args.gap_ms, "transports": results}))
        return 0
    print(f"one hop, sender idle {args.gap_ms:g} ms between messages, {args.count} messages each")
    print("| transport | p50 ms | p90 ms | p99 ms | max ms |")
    print("|---|---|---|---|---|")
    for t, r in results.items():
        print(f"| {t} | {r['p50_ms']:.3f} | {r['p90_ms']:.3f} | {r['p99_ms']:.3f} | {r['max_ms']:.2f} |")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m kvserve.cluster.bench.hop_latency",
                                     description=__doc__.split("\n")[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
