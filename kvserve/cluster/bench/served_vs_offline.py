"""Served vs offline throughput of one worker on a standard workload (issue 14, "the serving path's own cost").

One invocation starts a local cluster (one worker, ``--cpus-per-worker`` CPUs and as many torch threads),
then alternates, ``--rounds`` times: a *served* pass (every request of the workload sent at once through
``AsyncKVServeClient``; wall time from the first send to the last finished stream) and an *offline* pass
(``kvserve bench offline --runs 1`` in a fresh process with the same engine flags and threads, while the
cluster sits idle). Alternating keeps both figures under the same machine load; medians are reported.
The served tokens are checked against the offline run's (greedy, so they must be identical).

What the serving path costs per token (issue 41): each served pass's CPU seconds (``/proc``) of the router
process, of the frontends (``--frontends N``: the clients then call their shared port) and of the client,
divided by the tokens the pass streamed, as ``*_cpu_us_per_token``. ``--workers N`` serves with N
workers (the offline pass stays one engine: its tokens are the same, greedy). The machine's CPU model
and load average are in the summary: on a shared machine the figures carry others' load.

Usage::

    kvserve bench served --model /tmp/m-tiny --rounds 3 [--workers 2 --frontends 2] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kvserve.cluster.bench.proc_cpu import CpuReading, read_cpu
from kvserve.cluster.bench.workloads import WORKLOADS, prompts

IDLE_S = 2.0  # the window the router's idle CPU is read over, before the passes


@dataclass(frozen=True)
class ServedRun:
    """One served pass: output tokens per second and the tokens, in input order."""

    output_tokens_per_s: float
    seconds: float
    token_ids: list[list[int]]


async def served_pass(address: str, prompt_ids: list[list[int]], max_tokens: int) -> ServedRun:
    """Send every prompt at once (greedy, ignore_eos) and wait for all of them."""
    from kvserve.cluster.client import AsyncKVServeClient

    async with AsyncKVServeClient(address, timeout=600) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *(client.generate_all(p, max_tokens=max_tokens, temperature=0.0, ignore_eos=True) for p in prompt_ids)
        )
        seconds = time.perf_counter() - t0
    token_ids = [ids for ids, _, _ in results]
    return ServedRun(sum(len(t) for t in token_ids) / seconds, seconds, token_ids)


@dataclass(frozen=True)
class OfflineRun:
    """One offline pass: output tokens per second, CPU seconds of the process during the pass, the tokens."""

    output_tokens_per_s: float
    cpu_s: float
    token_ids: list[list[int]]


def offline_pass(args: argparse.Namespace) -> OfflineRun:
    """``bench offline``'s warm-up and one ``run_workload`` pass in a fresh process (same engine flags, threads)."""
    cmd = [sys.executable, "-m", "kvserve.cluster.bench.served_vs_offline", "--offline-child", "--model", args.model,
           "--workload", args.workload, "--cpus-per-worker", str(args.cpus_per_worker),
           "--block-size", str(args.block_size)]  # fmt: skip
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    return OfflineRun(r["output_tokens_per_s"], r["cpu_s"], r["token_ids"])


def _offline_child(args: argparse.Namespace) -> int:
    """The offline pass itself: exactly ``kvserve bench offline --runs 1``'s engine, warm-up and loop."""
    import torch

    from kvserve.cluster.bench.offline import _warm_up, run_workload
    from kvserve.workers.engine.config import EngineConfig
    from kvserve.workers.engine.engine import LLMEngine

    torch.set_num_threads(args.cpus_per_worker)
    prompt_ids, max_tokens = prompts(args.workload)
    engine = LLMEngine(EngineConfig(model=args.model, dtype="float32", block_size=args.block_size))
    _warm_up(engine, engine.model_config.vocab_size)
    engine.pool.reset_prefix_cache()
    cpu0 = time.process_time()
    result = run_workload(engine, prompt_ids, max_tokens)
    cpu_s = time.process_time() - cpu0
    print(json.dumps({"output_tokens_per_s": result.output_tokens_per_s, "cpu_s": cpu_s,
                      "token_ids": result.token_ids}))  # fmt: skip
    return 0


def _comm_names(pid: int) -> dict[int, str]:
    """The kernel's name of each thread of process ``pid`` (``/proc/<pid>/task/<tid>/comm``), by tid."""
    out: dict[int, str] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(tid)] = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        except OSError:
            continue
    return out


def _busiest(before: CpuReading, after: CpuReading, names: dict[int, str], default: str) -> dict[str, float]:
    """The 6 threads that spent the most CPU seconds between two readings of a process, as ``name/tid``."""
    spent = {tid: (ns - before.threads_ns.get(tid, 0)) / 1e9 for tid, ns in after.threads_ns.items()}
    top = sorted(((tid, s) for tid, s in spent.items() if s > 0), key=lambda kv: -kv[1])[:6]
    return {f"{names.get(tid, default)}/{tid}": round(s, 3) for tid, s in top}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True)
    p.add_argument("--workload", default="tiny", choices=sorted(WORKLOADS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cpus-per-worker", type=int, default=2)
    p.add_argument("--workers", type=int, default=1, help="served workers (the offline pass is one engine)")
    p.add_argument("--frontends", type=int, default=0, help="frontends in front of the router (clients call them)")
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--no-offline", action="store_true", help="served passes only (e.g. while profiling)")
    p.add_argument(
        "--py-spy",
        metavar="OUT",
        help="record the worker and the router with py-spy during the first served pass "
        "(collapsed stacks, --threads --idle --nonblocking) into OUT.worker and OUT.router",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--offline-child", action="store_true", help=argparse.SUPPRESS)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvserve bench served", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """One cluster, ``--rounds`` served (and offline) passes, the summary printed (module doc)."""
    if args.offline_child:
        return _offline_child(args)

    from kvserve.cluster.launch import start_cluster
    from kvserve.router.config import RouterConfig
    from kvserve.workers.engine.config import EngineConfig

    prompt_ids, max_tokens = prompts(args.workload)
    config = EngineConfig(model=args.model, dtype="float32", block_size=args.block_size)
    # NOTE: a free port (0), so a run beside a served cluster or another bench does not collide
    cluster = start_cluster(config, args.workers, RouterConfig(port=0), cpus_per_worker=args.cpus_per_worker,
                            frontends=args.frontends)
    address = f"127.0.0.1:{cluster.frontend_port}" if args.frontends else cluster.address
    served: list[float] = []
    seconds: list[float] = []  # wall seconds per served pass
    offline: list[float] = []
    worker_cpu: list[float] = []  # worker process CPU seconds per served pass
    router_cpu: list[float] = []
    frontend_cpu: list[float] = []
    client_cpu: list[float] = []
    per_token: dict[str, list[float]] = {"router": [], "frontends": [], "client": []}  # CPU us per streamed token
    offline_cpu: list[float] = []
    thread_cpu: list[dict[str, float]] = []  # worker CPU seconds per served pass, by thread name
    router_threads: list[dict[str, float]] = []  # the router's, by the kernel's thread name (Ray's and gRPC's)
    messages: list[int] = []  # WorkerLink messages the worker logged per served pass
    coalesced: list[int] = []  # steps folded into an earlier step's messages per served pass
    identical = True
    try:
        worker = next(iter(cluster.workers.values()))
        worker_pid, router_pid = _actor_pid(worker), _actor_pid(cluster.router)
        frontend_pids = [_actor_pid(f) for f in cluster.frontends]
        print(f"cluster up: router {cluster.address} (pid {router_pid}), worker pid {worker_pid}",
              file=sys.stderr, flush=True)  # fmt: skip
        asyncio.run(served_pass(address, prompt_ids[:2], 4))  # warm-up
        # NOTE: what the router spends per second with nothing to serve (timers, Ray's and gRPC's threads, the
        # links' acks): part of every pass's CPU, whatever the requests and tokens
        idle0 = read_cpu(router_pid)
        time.sleep(IDLE_S)
        router_idle_ms_per_s = read_cpu(router_pid).seconds_since(idle0) / IDLE_S * 1e3
        for i in range(args.rounds):
            spies = []
            if args.py_spy and i == 0:
                spies = [
                    _py_spy(pid, f"{args.py_spy}.{who}")
                    for who, pid in (("worker", worker_pid), ("router", router_pid))
                ]
                time.sleep(1.0)  # NOTE: let py-spy attach before the pass starts
            link0 = _link_counts(worker)
            # NOTE: schedstat as well as ticks (kvserve/cluster/bench/proc_cpu.py): a router pass costs ~0.1 s,
            # and one 10 ms tick more or less is 2.4 us per token of the tiny workload
            pids = (worker_pid, router_pid, *frontend_pids)
            before = [read_cpu(p) for p in pids]
            client0 = time.process_time()
            run = asyncio.run(served_pass(address, prompt_ids, max_tokens))
            client1 = time.process_time()
            after = [read_cpu(p) for p in pids]
            spent = [a.seconds_since(b) for a, b in zip(after, before, strict=True)]
            streamed = sum(len(t) for t in run.token_ids)
            link1 = _link_counts(worker)
            router_threads.append(_busiest(before[1], after[1], _comm_names(router_pid), "?"))
            thread_cpu.append(_busiest(before[0], after[0], _thread_names(worker), "native"))
            messages.append(link1[0] - link0[0])
            coalesced.append(link1[1] - link0[1])
            for spy in spies:
                spy.send_signal(signal.SIGINT)
                spy.wait(timeout=60)
            worker_cpu.append(spent[0])
            router_cpu.append(spent[1])
            client_cpu.append(client1 - client0)
            frontend_cpu.append(sum(spent[2:]))
            for who, cpu in (("router", router_cpu), ("frontends", frontend_cpu), ("client", client_cpu)):
                per_token[who].append(cpu[-1] / max(streamed, 1) * 1e6)
            served.append(run.output_tokens_per_s)
            seconds.append(run.seconds)
            line = (f"round {i}: served {run.output_tokens_per_s:.0f} tok/s ({run.seconds:.2f}s, {streamed} tokens; "
                    f"cpu s: worker {worker_cpu[-1]:.2f} router {router_cpu[-1]:.2f} frontends {frontend_cpu[-1]:.2f} "
                    f"client {client_cpu[-1]:.2f}; router {per_token['router'][-1]:.1f} us/token; "
                f"{messages[-1]} link messages, {coalesced[-1]} steps coalesced)")  # fmt: skip
            if not args.no_offline:
                off = offline_pass(args)
                offline.append(off.output_tokens_per_s)
                offline_cpu.append(off.cpu_s)
                same = off.token_ids == run.token_ids
                identical &= same
                line += f", offline {off.output_tokens_per_s:.0f} tok/s (cpu s {off.cpu_s:.2f}), identical: {same}"
            print(line + f", load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
    finally:
        cluster.shutdown()
    summary = {
        "workload": args.workload,
        "cpus_per_worker": args.cpus_per_worker,
        "served_output_tokens_per_s": [round(x, 1) for x in served],
        "offline_output_tokens_per_s": [round(x, 1) for x in offline],
        "served_median": statistics.median(served),
        "offline_median": statistics.median(offline) if offline else None,
        "ratio_of_medians": statistics.median(served) / statistics.median(offline) if offline else None,
        "per_round_ratios": [round(s / o, 3) for s, o in zip(served, offline, strict=False)],
        "identical_tokens": identical if offline else None,
        "served_worker_cpu_s_median": statistics.median(worker_cpu),
        "served_router_cpu_s_median": statistics.median(router_cpu),
        "served_client_cpu_s_median": statistics.median(client_cpu),
        "workers": args.workers,
        "frontends": args.frontends,
        "streamed_tokens_per_pass": len(prompt_ids) * max_tokens,
        **{f"{who}_cpu_us_per_token_median": round(statistics.median(v), 2) for who, v in per_token.items()},
        "router_idle_cpu_ms_per_s": round(router_idle_ms_per_s, 2),
        "served_seconds_median": statistics.median(seconds),
        "cpu_model": _cpu_model(),
        "worker_thread_cpu_s": thread_cpu,
        "router_thread_cpu_s": router_threads,
        "link_messages": messages,
        "steps_coalesced": coalesced,
        "offline_cpu_s_median": statistics.median(offline_cpu) if offline_cpu else None,
        "load_average_1m": os.getloadavg()[0],
    }
    print(json.dumps(summary) if args.json else "\n".join(f"{k}: {v}" for k, v in summary.items()))
    return 0


def _cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``) and the cores this process may use."""
    try:
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), "unknown")  # fmt: skip
    except OSError:
        model = "unknown"
    return f"{model} ({len(os.sched_getaffinity(0))} cores)"


def _py_spy(pid: int, out: str) -> subprocess.Popen:
    """``py-spy record`` of ``pid`` into ``out`` until SIGINT (py-spy sits beside this interpreter)."""
    exe = str(Path(sys.executable).with_name("py-spy"))
    cmd = [exe, "record", "--pid", str(pid), "--format", "raw", "--threads", "--idle", "--nonblocking",
           "--rate", "200", "-o", out]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL)


def _thread_names(worker) -> dict[int, str]:  # noqa: ANN001 - a Worker actor handle
    """Python thread names of the worker process by native thread id (OpenMP threads are not among them)."""
    import ray

    def names(_self: object) -> dict[int, str]:
        import threading

        return {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}

    return ray.get(worker.__ray_call__.remote(names))


def _link_counts(worker) -> tuple[int, int]:  # noqa: ANN001 - a Worker actor handle
    """(messages logged so far, steps coalesced so far) of the worker's outbox."""
    import ray

    return ray.get(worker.__ray_call__.remote(lambda self: (self.core.outbox.last_seq, self.core.outbox.num_coalesced)))


def _actor_pid(handle) -> int:  # noqa: ANN001 - a Ray actor handle
    import ray

    return ray.get(handle.__ray_call__.remote(lambda self: os.getpid()))


if __name__ == "__main__":
    sys.exit(main())
