"""``kvserve drain WORKER`` and ``kvserve rollout``: operator actions on a running cluster over the
router's gRPC ``kvserve.v1.Admin`` service (kvserve/router/requests/drain.py), with the same connection flags as
``kvserve status``. With client auth on, ``--auth-token`` must be the bearer token or an admin
API key.

``drain`` prints each change of the drain's progress and its outcome; ``rollout`` drains every
worker in turn (the next once the previous one is back and serving), e.g. after new weights or
config were put where the workers load them from; it skips retired workers and those down at its
start (they restart by themselves). Exit status: 0 done, 1 the router refused or a
drain failed (the message says why), 2 bad arguments or TLS files.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from kvserve.cluster.remote_cli import add_connection_arguments

# NOTE: a drain streams until its worker is back, which includes a model load: the call's deadline
# covers the drain's deadline plus this.
RESTART_ALLOWANCE_S = 600.0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("drain", help="drain one worker: move its requests away, restart it, take it back")
    p.add_argument("worker_id", help="e.g. worker-0 (see `kvserve status`)")
    _add_deadline(p)
    add_connection_arguments(p)
    p.set_defaults(func=cmd_drain)
    p = subparsers.add_parser("rollout", help="drain and restart every worker, one at a time")
    _add_deadline(p)
    add_connection_arguments(p)
    p.set_defaults(func=cmd_rollout)


def _add_deadline(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--deadline-s", type=float, default=0.0,
        help="longest a worker's requests may take to move away (default: the router's drain_deadline_s)",
    )  # fmt: skip


class _Admin:
    """An Admin stub on a channel opened as ``kvserve status`` opens one."""

    def __init__(self, args: argparse.Namespace) -> None:
        import grpc

        from kvserve.cluster.client import open_channel
        from kvserve.protos.kvserve.v1 import serving_pb2_grpc

        self.channel = open_channel(grpc, args.server, args.tls_ca, args.tls_cert, args.tls_key, None)
        self.stub = serving_pb2_grpc.AdminStub(self.channel)
        self.status_stub = serving_pb2_grpc.KVServeStub(self.channel)
        self.metadata = (("authorization", f"Bearer {args.auth_token}"),) if args.auth_token else ()
        self.timeout = args.timeout

    def close(self) -> None:
        self.channel.close()

    def status(self) -> Any:
        from kvserve.protos.kvserve.v1 import serving_pb2 as spb

        return self.status_stub.GetClusterStatus(spb.ClusterStatusRequest(), timeout=self.timeout,
                                                 metadata=self.metadata)  # fmt: skip

    def drain(self, worker_id: str, deadline_s: float) -> Any:
        """The drain's final DrainProgress, printing each step; grpc.RpcError if refused."""
        from kvserve.protos.kvserve.v1 import serving_pb2 as spb

        call = self.stub.DrainWorker(
            spb.DrainRequest(worker_id=worker_id, deadline_s=deadline_s),
            timeout=(deadline_s or 300.0) + RESTART_ALLOWANCE_S, metadata=self.metadata,
        )  # fmt: skip
        last, shown = None, None
        for last in call:
            line = describe(last)
            if line != shown:
                print(line, flush=True)
                shown = line
        if last is None:
            raise RuntimeError(f"{worker_id}: the router ended the drain without a word")
        return last


def describe(p: Any) -> str:
    """One line for a DrainProgress (what the CLI prints)."""
    counts = f"{p.requests_migrated} migrated, {p.requests_handed_off} handed off"
    if p.phase == "moving":
        return f"{p.worker_id}: draining ({p.reason}): requests left {p.requests_left}; {counts}"
    if p.phase == "restarting":
        return f"{p.worker_id}: requests moved ({counts}); restarting its process (was {p.old_incarnation[:8]})"
    if p.phase == "done":
        return (f"{p.worker_id}: drained and back in {p.elapsed_s:.1f}s ({counts}); "
                f"incarnation {p.old_incarnation[:8]} -> {p.new_incarnation[:8]}")  # fmt: skip
    if p.phase == "failed":
        return f"{p.worker_id}: drain FAILED after {p.elapsed_s:.1f}s: {p.reason}"
    return f"{p.worker_id}: {p.phase or 'starting'}"


def _run(args: argparse.Namespace, body: Any) -> int:
    import grpc

    try:
        admin = _Admin(args)
    except (OSError, ValueError) as e:  # unreadable TLS files, cert without key
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        return body(admin)
    except grpc.RpcError as e:
        print(f"error: {args.server}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    finally:
        admin.close()


def cmd_drain(args: argparse.Namespace) -> int:
    def body(admin: _Admin) -> int:
        final = admin.drain(args.worker_id, args.deadline_s)
        return 0 if final.phase == "done" else 1

    return _run(args, body)


def cmd_rollout(args: argparse.Namespace) -> int:
    def body(admin: _Admin) -> int:
        t0 = time.monotonic()
        workers = list(admin.status().workers)
        # NOTE: a worker that is down restarts by itself (Ray), loading what a drain's restart
        # would load; a retired one stays down until serve is restarted.
        todo = [w.worker_id for w in workers if w.state not in ("retired", "down")]
        for state in ("retired", "down"):
            skipped = [w.worker_id for w in workers if w.state == state]
            if skipped:
                print(f"skipping {state} workers: {', '.join(skipped)}")
        print(f"rolling out {len(todo)} workers one at a time: {', '.join(todo)}", flush=True)
        for worker_id in todo:
            final = admin.drain(worker_id, args.deadline_s)
            if final.phase != "done":
                print(f"rollout stopped at {worker_id}", file=sys.stderr)
                return 1
        print(f"rollout done: {len(todo)} workers restarted in {time.monotonic() - t0:.1f}s")
        return 0

    return _run(args, body)
