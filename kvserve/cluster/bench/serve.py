"""`kvserve bench serve`: an open-loop load against a router, measured as ``vllm bench serve`` does.

Target: a running router (``--server HOST:PORT`` with the client's auth/TLS flags) or, with
``--launch``, a cluster started here on a local Ray from the ``serve`` flags (``--model``,
``--workers``, engine flags...) and stopped afterwards. ``--policies a,b,c`` (``--launch`` only)
runs the identical dataset and arrivals against a fresh cluster per placement policy (caches start
cold) and prints one side-by-side table with ratios to ``kv_aware``; ``--request-rate 2,4,inf``
sweeps rates. ``--compare-offline`` then runs ``kvserve bench offline`` on the same workload
(``--dataset workload``) and prints served / offline output tok/s.

The driver (``drive``) sends each conversation at its arrival time (``datasets.arrival_times``),
each multi-turn round after the previous answer, at most ``--max-concurrency`` requests at once,
greedy with ``ignore_eos``, and polls ``GetClusterStatus`` for the router queue and per-worker KV
usage. One warm-up request (its own tenant, so it seeds no prefix) precedes every run.
Figures: ``kvserve/cluster/bench/serve_report.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvserve.cluster.bench.datasets import (
    DATASETS,
    Conversation,
    DatasetConfig,
    arrival_times,
    build_dataset,
    max_prompt_len,
    num_requests,
    schedule_digest,
)
from kvserve.cluster.bench.serve_report import (
    RequestRecord,
    RunResult,
    Slo,
    StatusSample,
    format_table,
    plot,
    summarize,
)

logger = logging.getLogger(__name__)

WARMUP_TENANT = "kvserve-bench-warmup"
POLICIES = ("kv_aware", "least_loaded", "round_robin")


# ---- the driver -----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DriveOptions:
    """How ``drive`` sends (validated).

    Raises:
        ValueError: a non-positive concurrency, poll interval or timeout.
    """

    max_concurrency: int | None = None
    status_interval_s: float = 0.2
    request_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.status_interval_s <= 0 or self.request_timeout_s <= 0:
            raise ValueError("status_interval_s and request_timeout_s must be > 0")


def _tier_hit_rates(r: Any) -> tuple[float, float]:
    """(host, disk): the share of a worker's prompt tokens loaded from each tier of its node so far."""
    q = r.prefix_cache_query_tokens_total
    return (r.prefix_cache_host_hit_tokens_total / q, r.prefix_cache_disk_hit_tokens_total / q) if q else (0.0, 0.0)


async def drive(
    client: Any,
    conversations: Sequence[Conversation],
    arrivals: Sequence[float],
    options: DriveOptions,
) -> tuple[list[RequestRecord], list[StatusSample], float]:
    """Send ``conversations`` at ``arrivals`` through ``client`` (an ``AsyncKVServeClient``).

    Returns:
        ``(records in send order, status samples, duration_s)``; the duration runs from the start
        to the last request's end.
    """
    import grpc

    t0 = time.monotonic()
    records: list[RequestRecord] = []
    samples: list[StatusSample] = []
    limit = asyncio.Semaphore(options.max_concurrency or 1 << 30)

    async def one(record: RequestRecord, max_tokens: int) -> None:
        async with limit:
            record.send_t = time.monotonic() - t0
            try:
                stream = client.generate(
                    record.prompt, max_tokens=max_tokens, ignore_eos=True, tenant=record.tenant,
                    timeout=options.request_timeout_s,
                )  # fmt: skip
                async with stream:
                    async for response in stream:
                        now = time.monotonic() - t0
                        if response.token_ids:
                            record.first_t = now if record.first_t is None else record.first_t
                            record.chunk_times.append(now)
                            record.output_ids.extend(response.token_ids)
                        if response.finish_reason:
                            record.end_t = now
                            record.cached_tokens = response.usage.cached_tokens
                            record.worker_id = response.worker_id
                            record.preemptions = response.num_preemptions
                            record.swaps = response.num_swaps
                            record.migrations = response.num_migrations
                            record.status = "ok" if response.finish_reason in ("stop", "length") else "failed"
                            record.error = "" if record.status == "ok" else response.finish_reason
            except grpc.RpcError as e:
                exhausted = e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                record.status = "rejected" if exhausted else "failed"
                record.error = f"{e.code().name}: {e.details()}"
            if record.status == "pending":
                record.status, record.error = "failed", "stream ended without a finish_reason"

    async def conversation(index: int, conv: Conversation, at: float) -> None:
        await asyncio.sleep(max(0.0, at - (time.monotonic() - t0)))
        history: list[int] = []
        for turn in conv.rounds:
            prompt = history + list(turn.prompt) if conv.chained else list(turn.prompt)
            record = RequestRecord(index, turn.round, turn.tenant, prompt, send_t=math.nan, group=turn.group)
            records.append(record)
            await one(record, turn.max_tokens)
            if record.status != "ok":
                return  # NOTE: a conversation cannot continue without its answer
            history = prompt + record.output_ids

    async def poll(stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                st = await client.status(timeout=5.0)
                samples.append(
                    StatusSample(
                        t=time.monotonic() - t0,
                        queue_requests=st.router.queue_requests,
                        usage={w.worker_id: w.usage for w in st.workers},  # the report's used / total blocks
                        waiting={w.worker_id: w.report.num_waiting for w in st.workers},
                        tier_hit_rates={w.worker_id: _tier_hit_rates(w.report) for w in st.workers},
                    )
                )  # fmt: skip
            except grpc.RpcError as e:
                logger.debug("status poll failed: %s", e)
            try:
                await asyncio.wait_for(stop.wait(), options.status_interval_s)
            except TimeoutError:
                pass

    stop = asyncio.Event()
    poller = asyncio.create_task(poll(stop))
    try:
        await asyncio.gather(*(conversation(i, c, t) for i, (c, t) in enumerate(zip(conversations, arrivals,
                                                                                     strict=True))))  # fmt: skip
    finally:
        stop.set()
        await poller
    ends = [r.end_t for r in records if r.end_t is not None]
    duration = max(ends) if ends else time.monotonic() - t0
    records.sort(key=lambda r: r.send_t)
    return records, samples, duration


async def _warm_up(client: Any, length: int, vocab: int) -> None:
    # NOTE: its own tenant salts its blocks, so the warm-up seeds no prefix the dataset could hit.
    prompt = [(7 * i + 3) % vocab for i in range(max(1, length))]
    await client.generate_all(prompt, max_tokens=4, ignore_eos=True, tenant=WARMUP_TENANT, timeout=300)


async def run_against(
    address: str,
    client_kwargs: dict[str, Any],
    conversations: Sequence[Conversation],
    arrivals: Sequence[float],
    options: DriveOptions,
    *,
    warm_up_len: int,
    vocab: int,
) -> tuple[list[RequestRecord], list[StatusSample], float]:
    """Warm up, then ``drive`` against the router at ``address``."""
    from kvserve.cluster.client import AsyncKVServeClient

    async with AsyncKVServeClient(address, max_attempts=1, **client_kwargs) as client:
        await _warm_up(client, warm_up_len, vocab)
        return await drive(client, conversations, arrivals, options)


# ---- launching clusters ---------------------------------------------------------------------------
class LaunchedCluster:
    """A cluster started for one run (``--launch``), on the Ray this process started."""

    def __init__(self, cfg: Any, policy: str) -> None:
        from kvserve.cluster.launch import start_cluster

        gpus = _ray_gpus()
        router = dataclasses.replace(cfg.router, placement_policy=policy)
        self.cluster = start_cluster(
            cfg.engine,
            cfg.num_workers(gpus),
            router,
            metrics_port=None,
            cpus_per_worker=cfg.cpus_per_worker,
            use_gpus=cfg.use_gpus(gpus),
            worker_options=cfg.worker_options(),
            ready_timeout_s=cfg.ready_timeout_s,
        )

    @property
    def address(self) -> str:
        return self.cluster.address

    def stop(self) -> None:
        self.cluster.shutdown()


def _ray_gpus() -> int:
    import ray

    return int(ray.cluster_resources().get("GPU", 0))


def launch_config(args: argparse.Namespace) -> Any:
    """The ClusterConfig of ``--launch``: ``--config`` plus the serve flags; port 0 unless given.

    Raises:
        ValueError: a bad value (naming its key).
    """
    from kvserve.cluster.serve_cli import UNSET, config_from_args

    ns = argparse.Namespace(**vars(args))
    # NOTE: --tls-cert/--tls-key here are the *client's* (mTLS to --server); the launched cluster is plaintext.
    ns.tls_cert = ns.tls_key = UNSET
    ns.auth_token = args.auth_token or UNSET
    if ns.port is UNSET:
        ns.port = 0  # NOTE: a free port: a bench must not collide with a cluster already serving on 50051
    ns.metrics_port = None
    ns.knob_flags = {**args.knob_flags, "auth_token": ("router", "auth_token"), "metrics_port": (None, "metrics_port")}
    return config_from_args(ns)


# ---- CLI ------------------------------------------------------------------------------------------
def _rates(text: str) -> list[float]:
    out = []
    for part in text.split(","):
        value = math.inf if part.strip() in ("inf", "") else float(part)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"request rates must be > 0 or inf, got {part!r}")
        out.append(value)
    return out


def _policies(text: str) -> list[str]:
    out = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in out if p not in POLICIES]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"policies must be among {', '.join(POLICIES)}, got {text!r}")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``kvserve bench serve``."""
    from kvserve.cluster.cli import _add_engine_arguments
    from kvserve.cluster.config import _workers_arg
    from kvserve.cluster.remote_cli import add_connection_arguments
    from kvserve.cluster.serve_cli import UNSET

    add_connection_arguments(p)
    t = p.add_argument_group("launch (instead of --server)")
    t.add_argument("--launch", action="store_true", help="start a cluster on a local Ray per policy, stop it after")
    t.add_argument("--model", help="HF model directory (--launch; also gives the vocabulary size)")
    t.add_argument("--config", default=None, help="cluster.yaml for --launch; flags override it")
    t.add_argument("--workers", type=_workers_arg, help="workers (--launch; default: one per GPU, else 2)")
    t.add_argument("--cpus-per-worker", type=int, help="Ray CPUs and torch threads per CPU worker (--launch)")
    t.add_argument("--port", type=int, help="router port for --launch (default: a free one)")
    t.add_argument(
        "--policies",
        type=_policies,
        default=None,
        help="comma list of placement policies, same arrivals each, a fresh cluster each (--launch)",
    )
    before = set(vars(p.parse_known_args([])[0]))
    _add_engine_arguments(p)
    engine_dests = sorted(set(vars(p.parse_known_args([])[0])) - before)

    a = p.add_argument_group("load")
    a.add_argument("--request-rate", type=_rates, default=[math.inf], help="req/s, a comma list sweeps (default: inf)")
    a.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of inter-arrivals (1 = Poisson)")
    a.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: no cap)")
    a.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    a.add_argument("--status-interval", type=float, default=0.2, help="seconds between GetClusterStatus polls")
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset", choices=DATASETS, default="random")
    d.add_argument("--num-prompts", type=int, default=100, help="random: requests")
    d.add_argument("--vocab-size", type=int, default=None, help="token ids drawn below this (default: --model's)")
    d.add_argument("--random-input-len", type=str, default="16:256", help="random: MIN:MAX prompt tokens")
    d.add_argument("--random-output-len", type=int, default=64)
    d.add_argument("--gsp-num-groups", type=int, default=8)
    d.add_argument("--gsp-prompts-per-group", type=int, default=16)
    d.add_argument("--gsp-system-prompt-len", type=int, default=512)
    d.add_argument("--gsp-question-len", type=int, default=64)
    d.add_argument("--gsp-output-len", type=int, default=32)
    d.add_argument("--gsp-zipf", type=float, default=None, metavar="S", help="Zipf group popularity 1/rank**S")
    d.add_argument("--tenants", type=int, default=1, help="tenants salting the cache (shared-prefix, multi-turn)")
    d.add_argument("--mt-users", type=int, default=8)
    d.add_argument("--mt-rounds", type=int, default=4)
    d.add_argument("--mt-system-prompt-len", type=int, default=128)
    d.add_argument("--mt-question-len", type=int, default=32)
    d.add_argument("--mt-output-len", type=int, default=32)
    d.add_argument("--workload", default="tiny", help="workload dataset: a `bench offline` workload")
    o = p.add_argument_group("report")
    o.add_argument("--goodput", default=None, help="SLOs, e.g. ttft:500,tpot:50 (ms)")
    o.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    o.add_argument("--json-out", default=None, help="also write the JSON (summaries + per-request records) here")
    o.add_argument("--plot", default=None, metavar="PNG", help="per-worker KV usage, router queue, TTFT over time")
    o.add_argument("--compare-offline", action="store_true",
                   help="--launch, one policy: then run `bench offline` on the same workload; print served/offline")
    o.add_argument("--offline-runs", type=int, default=3, help="--compare-offline: `bench offline --runs` (median)")
    # NOTE: the engine's --seed (default 0) doubles as the dataset and arrival seed, as in `vllm bench serve`.
    defaults: dict[str, Any] = {dest: UNSET for dest in engine_dests if dest != "seed"}
    defaults.update(model=UNSET, workers=UNSET, cpus_per_worker=UNSET, port=UNSET)
    # NOTE: the dest -> (cluster.yaml section, key) map that serve_cli.config_from_args reads.
    knob_flags: dict[str, tuple[str | None, str]] = {d: ("engine", d) for d in engine_dests if d != "seed"}
    knob_flags.update({k: (None, k) for k in ("model", "workers", "cpus_per_worker", "port")})
    p.set_defaults(**defaults, knob_flags=knob_flags)


def dataset_config(args: argparse.Namespace, vocab: int) -> DatasetConfig:
    lo, _, hi = args.random_input_len.partition(":")
    return DatasetConfig(
        name=args.dataset,
        vocab_size=vocab,
        num_prompts=args.num_prompts,
        input_len_min=int(lo),
        input_len_max=int(hi or lo),
        output_len=args.random_output_len,
        gsp_num_groups=args.gsp_num_groups,
        gsp_prompts_per_group=args.gsp_prompts_per_group,
        gsp_system_prompt_len=args.gsp_system_prompt_len,
        gsp_question_len=args.gsp_question_len,
        gsp_output_len=args.gsp_output_len,
        zipf_s=args.gsp_zipf,
        tenants=args.tenants,
        mt_num_users=args.mt_users,
        mt_num_rounds=args.mt_rounds,
        mt_system_prompt_len=args.mt_system_prompt_len,
        mt_question_len=args.mt_question_len,
        mt_output_len=args.mt_output_len,
        workload=args.workload,
    )


def _vocab(args: argparse.Namespace) -> int:
    if args.vocab_size:
        return args.vocab_size
    model = args.model if isinstance(args.model, str) else None
    if model and (Path(model) / "config.json").is_file():
        return int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])
    raise ValueError("--vocab-size is needed (or --model DIR with a config.json)")


def run(args: argparse.Namespace) -> int:
    """Parse, build the dataset, run every (rate, policy), report. Returns the exit status."""
    from kvserve.cluster.serve_cli import UNSET

    try:
        slo = Slo.parse(args.goodput)
        vocab = _vocab(args)
        dcfg = dataset_config(args, vocab)
        options = DriveOptions(args.max_concurrency, args.status_interval, args.request_timeout)
        if args.burstiness <= 0:
            raise ValueError("--burstiness must be > 0")
        if not args.launch and (args.policies and len(args.policies) > 1 or args.compare_offline):
            raise ValueError("--policies with several policies and --compare-offline need --launch")
        cfg = launch_config(args) if args.launch else None
        if args.compare_offline and (args.dataset != "workload" or len(args.policies or ["x"]) != 1):
            raise ValueError("--compare-offline needs --dataset workload and one policy")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    policies = args.policies or ([cfg.router.placement_policy] if cfg else ["server"])
    block_size = cfg.engine.block_size if cfg else (args.block_size if args.block_size is not UNSET else 16)
    conversations = build_dataset(dcfg, args.seed)
    client_kwargs = {"auth_token": args.auth_token or None, "tls_ca": args.tls_ca, "tls_cert": args.tls_cert,
                     "tls_key": args.tls_key}  # fmt: skip
    if args.launch:
        client_kwargs = {"auth_token": cfg.router.auth_token}
    print(f"bench serve: {args.dataset}, {num_requests(conversations)} requests in {len(conversations)} "
          f"conversations, longest prompt {max_prompt_len(conversations)} tokens", file=sys.stderr)  # fmt: skip
    runs: list[RunResult] = []
    started_ray = False
    try:
        if args.launch:
            from kvserve.cluster.serve_cli import init_ray

            workers = cfg.workers if cfg.workers != "auto" else 2
            started_ray = init_ray(cfg.address, num_cpus=max(os.cpu_count() or 1, workers * cfg.cpus_per_worker + 1))
        for rate in args.request_rate:
            arrivals = arrival_times(len(conversations), rate, args.burstiness, args.seed)
            digest = schedule_digest(conversations, arrivals)
            for policy in policies:
                cluster = LaunchedCluster(cfg, policy) if args.launch else None
                address = cluster.address if cluster else args.server
                try:
                    records, samples, duration = asyncio.run(
                        run_against(address, client_kwargs, conversations, arrivals, options,
                                    warm_up_len=min(64, max_prompt_len(conversations)), vocab=vocab)
                    )  # fmt: skip
                finally:
                    if cluster is not None:
                        cluster.stop()
                runs.append(RunResult(policy, rate, digest, duration, block_size, records, samples))
                print(f"bench serve: {policy} @ {rate:g}/s done in {duration:.1f}s", file=sys.stderr)
    finally:
        if started_ray:
            import ray

            ray.shutdown()
    summaries = [summarize(r, slo) for r in runs]
    report: dict[str, Any] = {"dataset": dataclasses.asdict(dcfg), "seed": args.seed, "block_size": block_size,
                              "runs": summaries}  # fmt: skip
    if args.compare_offline:
        report["offline"] = offline_output_throughput(args, cfg)
        served = summaries[0]["output_throughput"]
        report["served_over_offline"] = served / report["offline"]["output_tokens_per_s"]
    if args.json_out:
        full = dict(report, records=[[dataclasses.asdict(rec) for rec in r.records] for r in runs])
        Path(args.json_out).write_text(json.dumps(full, default=str))
    if args.plot:
        try:
            plot(runs, args.plot)
        except ImportError:
            print("warning: --plot needs matplotlib (pip install 'kvserve[bench]')", file=sys.stderr)
    if args.json:
        print(json.dumps(report, default=str))
    else:
        print(format_table(summaries))
        if args.compare_offline:
            off = report["offline"]["output_tokens_per_s"]
            print(f"\nserved {summaries[0]['output_throughput']:.1f} output tok/s vs offline {off:.1f}: "
                  f"{report['served_over_offline']:.1%}")  # fmt: skip
    return 0


def offline_output_throughput(args: argparse.Namespace, cfg: Any) -> dict[str, Any]:
    """``kvserve bench offline`` (a subprocess, after the cluster is gone) on the same workload, engine
    and thread count; its JSON summary (median of ``--offline-runs`` runs after its own warm-up)."""
    e = cfg.engine
    argv = [sys.executable, "-m", "kvserve.cluster.cli", "bench", "offline", "--model", cfg.model, "--workload",
            args.workload, "--runs", str(args.offline_runs), "--json", "--threads", str(cfg.cpus_per_worker),
            "--block-size", str(e.block_size), "--dtype", str(e.dtype)]  # fmt: skip
    if e.num_gpu_blocks is not None:
        argv += ["--num-gpu-blocks", str(e.num_gpu_blocks)]
    out = subprocess.run(argv, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])
