"""`kvserve bench compare-serve`: kvserve's HTTP server side by side with vLLM's own serving setups,
driven by vLLM's own client, on the same model and machine.

Each round starts, one after the other, every target of ``kvserve/cluster/bench/serve_targets.py`` (``kvserve``:
``kvserve serve --http-port``; ``vllm``: one ``vllm serve``; ``vllm-router``: two ``vllm serve`` pinned
one core each behind ``vllm-router``, when its venv exists), waits for it, drives it with
``vllm bench serve`` from the peer venv (identical arguments for every target: dataset, seed, greedy,
``--ignore-eos``), optionally with ``guidellm`` too, and stops it with everything it started. Targets
start fresh every round, so no round hits a prefix cache an earlier one filled (the prompts repeat:
same seed); the order alternates across rounds (forward, reversed, ...) so neither side always runs
first on a machine that warms up or gets busier. The table gives medians over rounds and
kvserve / target ratios (``kvserve/cluster/bench/compare_serve_report.py``); ``--json`` prints one object.
While ``vllm bench serve`` runs, every process's CPU time is summed by role (``kvserve/cluster/bench/cpu_share.py``:
engine, serving stack, Ray's daemons, client, other), and a second table gives each target's medians in
cores (CPU seconds over the benchmark's duration): how much of the machine the engine got.

Run it under the machine's Ray lock when other clusters may start (``flock /tmp/kvserve-ray.lock ...``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvserve.cluster.bench import compare_serve_clients as clients
from kvserve.cluster.bench import serve_targets as targets
from kvserve.cluster.bench.compare_serve_report import (
    ClientResult,
    ResultError,
    cpu_summary,
    format_cpu_table,
    format_table,
    summarize,
)
from kvserve.cluster.bench.cpu_share import CpuSampler
from kvserve.cluster.bench.procs import ServerError
from kvserve.cluster.process_signals import signals_as_keyboard_interrupt

TARGETS = ("kvserve", "vllm", "vllm-router")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``kvserve bench compare-serve``."""
    p.add_argument("--peer", default="vllm", choices=["vllm"], help="the peer serving stack (default: vllm)")
    p.add_argument("--peer-python", default=None, metavar="PATH",
                   help="the vLLM venv's interpreter; `vllm` beside it serves and benches "
                        "(default: $KVSERVE_PEER_PYTHON; kvserve/cluster/bench/setup_peers.sh builds it)")  # fmt: skip
    p.add_argument("--model", required=True, help="HF model directory (all targets serve it)")
    p.add_argument("--served-model-name", default=None,
                   help="the name every target serves and the client asks for (default: --model, what "
                        "`kvserve serve` lists)")  # fmt: skip
    p.add_argument("--workload", default="random", choices=sorted(clients.WORKLOADS),
                   help="vllm bench serve dataset (default: random)")  # fmt: skip
    p.add_argument("--num-prompts", type=int, default=64, help="requests per client run (default: 64)")
    p.add_argument("--max-concurrency", type=int, default=16, help="client concurrency (default: 16)")
    p.add_argument("--runs", type=int, default=3, help="rounds; medians over them (default: 3)")
    p.add_argument("--seed", type=int, default=0, help="dataset seed, the same every round and target")
    p.add_argument("--input-len", type=int, default=256, help="random: prompt tokens (default: 256)")
    p.add_argument("--output-len", type=int, default=64, help="random: output tokens (default: 64)")
    p.add_argument("--prefix-len", type=int, default=512, help="prefix_repetition: prefix tokens (default: 512)")
    p.add_argument("--suffix-len", type=int, default=64, help="prefix_repetition: suffix tokens (default: 64)")
    p.add_argument("--num-prefixes", type=int, default=8, help="prefix_repetition: prefixes (default: 8)")
    p.add_argument("--prefix-output-len", type=int, default=32,
                   help="prefix_repetition: output tokens (default: 32)")  # fmt: skip
    p.add_argument("--targets", default=",".join(TARGETS),
                   help="comma list of kvserve,vllm,vllm-router (default: all; vllm-router only if its venv "
                        "exists)")  # fmt: skip
    p.add_argument("--router-bin", default=None, metavar="PATH",
                   help="vllm-router executable (default: vllm-router/bin/vllm-router beside the vLLM venv)")
    p.add_argument("--guidellm-bin", default=None, metavar="PATH",
                   help="also drive every target with guidellm (random workload; default: guidellm/bin/guidellm "
                        "beside the vLLM venv if it exists; 'none' to skip)")  # fmt: skip
    p.add_argument("--workers", type=int, default=None, help="kvserve serve --workers")
    p.add_argument("--cpus-per-worker", type=int, default=None, help="kvserve serve --cpus-per-worker")
    p.add_argument("--kvserve-arg", action="append", default=[], metavar="ARG",
                   help="one more `kvserve serve` argument (repeat; e.g. --kvserve-arg=--block-size=4)")
    p.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for every `vllm serve` (repeat; e.g. --vllm-arg=--max-num-seqs=16)")
    p.add_argument("--vllm-kv-cache-gib", type=float, default=4.0,
                   help="VLLM_CPU_KVCACHE_SPACE of each vllm serve (default: 4)")  # fmt: skip
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds a server may take to start")
    p.add_argument("--client-timeout", type=float, default=1800.0, help="seconds one client run may take")
    p.add_argument("--log-dir", default=None, help="servers' and clients' logs (default: a new temp dir, kept)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")


def _sibling(peer_python: str, venv: str, exe: str) -> Path:
    """``<peers dir>/<venv>/bin/<exe>`` where the vLLM venv is ``<peers dir>/vllm`` (setup_peers.sh's layout).

    NOTE: the interpreter path is not resolved: a venv's python is a link to the base interpreter.
    """
    return Path(peer_python).parent.parent.parent / venv / "bin" / exe


def plan_targets(args: argparse.Namespace, vllm: str, served_name: str) -> list[targets.Target]:
    """The targets of one round, in the first round's order (raises ValueError on a bad ``--targets``)."""
    chosen = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = sorted(set(chosen) - set(TARGETS))
    if unknown or not chosen:
        raise ValueError(f"--targets: unknown {unknown} (expected a comma list of {', '.join(TARGETS)})")
    out = []
    for name in chosen:
        if name == "kvserve":
            out.append(targets.kvserve_target(args.model, served_name, args.workers, args.cpus_per_worker,
                                              args.kvserve_arg))  # fmt: skip
        elif name == "vllm":
            out.append(targets.vllm_target(vllm, args.model, served_name, args.vllm_kv_cache_gib, args.vllm_arg))
        elif name == "vllm-router":
            router = args.router_bin or str(_sibling(args.peer_python, "vllm-router", "vllm-router"))
            if not Path(router).exists():
                print(f"compare-serve: no vllm-router at {router} (setup_peers.sh vllm-router); "
                      "skipping the two-engine target", file=sys.stderr)  # fmt: skip
                continue
            out.append(targets.vllm_router_target(vllm, router, args.model, served_name, args.workload,
                                                  args.vllm_kv_cache_gib, args.vllm_arg))  # fmt: skip
    return out


def round_order(items: list, round_index: int) -> list:
    """Forward on even rounds, reversed on odd ones: each target runs first as often as last."""
    return list(items) if round_index % 2 == 0 else list(reversed(items))


def _guidellm(args: argparse.Namespace) -> str | None:
    """The guidellm executable to use, or None (not asked for, absent, or a workload it has no twin of)."""
    if args.guidellm_bin == "none":
        return None
    path = args.guidellm_bin or str(_sibling(args.peer_python, "guidellm", "guidellm"))
    if not Path(path).exists():
        if args.guidellm_bin:
            raise ValueError(f"--guidellm-bin {path} does not exist")
        return None
    if args.workload != "random":
        print("compare-serve: guidellm runs the random workload only (no prefix_repetition twin); skipped",
              file=sys.stderr)  # fmt: skip
        return None
    return path


def _run_client(argv: list[str], log: Path, timeout_s: float) -> None:
    """Run one client command to completion, output to ``log``.

    Raises:
        ResultError: it failed or timed out (the message names the log and shows its tail).
    """
    with log.open("ab") as f:
        f.write(f"$ {' '.join(argv)}\n".encode())
        f.flush()
        try:
            # Its own session, so that a Ctrl-C of compare-serve is handled once, by us (servers stopped).
            status = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    timeout=timeout_s, start_new_session=True).returncode  # fmt: skip
        except subprocess.TimeoutExpired as e:
            raise ResultError(f"{argv[0]} ran past {timeout_s:.0f} s; log {log}") from e
    if status != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise ResultError(f"{' '.join(argv[:3])} exited with status {status}; log {log}:\n{tail}")


def _one_target(
    args: argparse.Namespace, target: targets.Target, vllm: str, guidellm: str | None, served_name: str,
    round_dir: Path,
) -> tuple[dict[str, ClientResult], dict]:  # fmt: skip
    """Launch ``target``, run the client(s) against it, stop it; ``{client name: result}`` and where the CPU
    went while ``vllm bench serve`` ran (``{"cpu_seconds": {role: s}, "duration_s": its benchmark's}``)."""
    work = round_dir / target.name
    work.mkdir(parents=True, exist_ok=True)  # a reused --log-dir: this round's files replace the old ones
    out: dict[str, ClientResult] = {}
    with targets.launch(target, work, served_name, args.ready_timeout) as base_url:
        spec = clients.bench_spec_from_args(args, served_name)
        result_file = work / "vllm-bench.json"
        with CpuSampler() as cpu:
            _run_client(clients.vllm_bench_command(vllm, base_url, spec, result_file), work / "vllm-bench.log",
                        args.client_timeout)  # fmt: skip
        out["vllm bench serve"] = clients.read_vllm_bench(result_file)
        cpu_use = {"cpu_seconds": cpu.cpu_seconds, "duration_s": clients.read_vllm_bench_duration(result_file),
                   "stack_seconds": cpu.stack_seconds,
                   "output_tokens": clients.read_vllm_bench_output_tokens(result_file)}  # fmt: skip
        (work / "cpu.json").write_text(json.dumps({**cpu_use, "processes": cpu.processes}, indent=1))
        if guidellm is not None:
            gl_dir = work / "guidellm"
            _run_client(clients.guidellm_command(guidellm, base_url, spec, gl_dir), work / "guidellm.log",
                        args.client_timeout)  # fmt: skip
            out["guidellm"] = clients.read_guidellm(gl_dir)
    return out, cpu_use


def run(args: argparse.Namespace) -> int:
    """Rounds of every target with every client; print the tables (or JSON). 0 ok, 1 a run failed, 2 usage."""
    peer_python = args.peer_python or os.environ.get("KVSERVE_PEER_PYTHON")
    if not peer_python:
        print("error: --peer-python PATH (or $KVSERVE_PEER_PYTHON) is needed: the vLLM venv's interpreter "
              "(kvserve/cluster/bench/setup_peers.sh vllm)", file=sys.stderr)  # fmt: skip
        return 2
    args.peer_python = peer_python
    vllm = str(Path(peer_python).parent / "vllm")
    served_name = args.served_model_name or args.model
    try:
        if args.runs <= 0 or args.num_prompts <= 0 or args.max_concurrency <= 0:
            raise ValueError("--runs, --num-prompts and --max-concurrency must be positive")
        if not Path(vllm).exists():  # the client (vllm bench serve), whatever the targets
            raise ValueError(f"no `vllm` at {vllm} (run kvserve/cluster/bench/setup_peers.sh vllm)")
        if not (Path(args.model) / "config.json").is_file():
            raise ValueError(f"--model {args.model} has no config.json")
        guidellm = _guidellm(args)
        plan = plan_targets(args, vllm, served_name)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvserve-compare-serve-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, list[ClientResult]]] = {}
    cpu_rounds: dict[str, list[dict]] = {}
    t0 = time.monotonic()
    # SIGTERM unwinds like Ctrl-C, through launch(): every server started is stopped on the way out.
    with signals_as_keyboard_interrupt():
        status = _rounds(args, plan, vllm, guidellm, served_name, log_dir, results, cpu_rounds)
    if status != 0:
        return status
    report = {
        "config": clients.describe(args, served_name, plan),
        "machine": clients.machine(),
        "seconds": round(time.monotonic() - t0, 1),
        "log_dir": str(log_dir),
        "clients": {client: summarize(per_target) for client, per_target in results.items()},
        "cpu": cpu_summary(cpu_rounds),
    }
    if args.json:
        print(json.dumps(report))
    else:
        print(_header(report))
        for client, summary in report["clients"].items():
            print()
            print(format_table(summary, f"{client}, {args.workload}: medians of {args.runs} rounds"))
        print()
        print(format_cpu_table(report["cpu"], report["machine"]["cores"]))
    return 0


def _rounds(
    args: argparse.Namespace, plan: list[targets.Target], vllm: str, guidellm: str | None, served_name: str,
    log_dir: Path, results: dict[str, dict[str, list[ClientResult]]], cpu_rounds: dict[str, list[dict]],
) -> int:  # fmt: skip
    """Every round of every target; appends to ``results[client][target]`` and ``cpu_rounds[target]``.
    Returns 0, or 1 / 130 after a failure / an interrupt (the message printed; the servers are stopped by
    then)."""
    try:
        for i in range(args.runs):
            for target in round_order(plan, i):
                print(f"compare-serve: round {i + 1}/{args.runs}: {target.name} ...", file=sys.stderr, flush=True)
                got, cpu_use = _one_target(args, target, vllm, guidellm, served_name, log_dir / f"round-{i + 1}")
                cpu_rounds.setdefault(target.name, []).append(cpu_use)
                for client, result in got.items():
                    results.setdefault(client, {}).setdefault(target.name, []).append(result)
                print(f"compare-serve: round {i + 1}: {target.name}: "
                      f"{got['vllm bench serve'].output_tokens_per_s:.1f} output tok/s", file=sys.stderr)  # fmt: skip
    except (ServerError, ResultError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("compare-serve: interrupted; servers stopped", file=sys.stderr)
        return 130
    return 0


def _header(report: dict) -> str:
    m, c = report["machine"], report["config"]
    return "\n".join([
        f"compare-serve {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {m['cpu']} ({m['cores']} cores; "
        f"{m['flags']}); load average {m['load_average']}",
        f"model {c['model']}; {c['client']}; targets: {'; '.join(c['targets'])}",
        f"logs: {report['log_dir']}",
    ])  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m kvserve.cluster.bench.compare_serve",
                                     description=__doc__.split("\n")[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
