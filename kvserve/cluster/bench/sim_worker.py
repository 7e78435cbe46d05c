"""A simulated worker for the data-plane benchmark: the real worker's Ray methods and WorkerLink, with
tokens emitted on a clock instead of by a model (no torch).

Every ``step_ms`` it emits ``tokens_per_step`` tokens for each running request (one ``StepOutputs``
for all of them, through the real ``Outbox`` and ``WorkerLinkClient``), until the request's
``max_tokens``. Its pressure reports follow the real worker's policy (``PressurePolicy`` with the
worker options' intervals: after a step that changed block counts, at most every
``pressure_interval_ms``), over a pool whose used blocks are what its requests' tokens fill; each
block a request fills is announced as the real pool does (one ``BlockStored`` event per block, in
the step's ``BlockEvents``).
Each output's ``text_delta`` carries the step's emission time (``time.monotonic_ns()``,
system-wide on Linux), so a client on the same machine measures the latency the serving path adds
to every token.

``SimSpec.realistic`` (``kvserve bench data-plane --sim realistic``, issue 41 item 6): what a real
worker sends besides the tokens, as its block pool (kvserve/workers/engine/block_pool.py) would: the
prompt's full blocks announced (``BlockStored``, the real hash chain, so the router's prefix index
matches its own hashes) at the request's first step, leading blocks already cached reused instead
(prefix hits), a finished request's full blocks kept as cached and evictable, and the least
recently used of them evicted when the pool runs out (``BlockRemoved``); its pressure reports carry
the pool's free / used / evictable counts, tokens in flight, prefill and prefix-cache counters.

Owned requests (``WorkerRequest.owner``, docs/architecture.md section 2a) stream as a real worker streams
them: their tokens to the owner over the worker's own ``DataLinks``, ids ``<key>#<tag>``; the router gets
their progress only (first output, finish, at most every ``PROGRESS_INTERVAL_S``).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.workers.core.add_command import request_from_proto
from kvserve.workers.core.block_hash import cache_extra, hash_block, hash_blocks
from kvserve.workers.core.gc_pauses import settle_heap
from kvserve.workers.core.identity import WorkerIdentity
from kvserve.workers.core.request import WorkerRequest
from kvserve.workers.core.sizes import blocks_for
from kvserve.workers.core.step_columns import append_entry
from kvserve.workers.core.tls import channel_credentials
from kvserve.workers.transport.data_links import PROGRESS_INTERVAL_S, DataLinks, owner_request_id
from kvserve.workers.transport.options import WorkerOptions
from kvserve.workers.transport.outbox import Outbox
from kvserve.workers.transport.pressure import PressurePolicy
from kvserve.workers.transport.worker_link import WorkerLinkClient


@dataclass(frozen=True)
class SimSpec:
    """What a simulated worker looks like and how fast it emits.

    Raises:
        ValueError: a non-positive size or rate.
    """

    step_ms: float = 20.0
    tokens_per_step: int = 1
    total_blocks: int = 1 << 16
    block_size: int = 16
    max_model_len: int = 1 << 16
    vocab_size: int = 32000
    realistic: bool = False  # a real worker's block events and reports (module doc)

    def __post_init__(self) -> None:
        for name in ("step_ms", "tokens_per_step", "total_blocks", "block_size", "max_model_len", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


@dataclass
class _Running:
    request: WorkerRequest
    emitted: int = 0
    hashes: list[int] | None = None  # realistic: its full blocks' hash chain (None: not prefilled yet)
    progress_at: float | None = None  # owned: when the router last got its progress (None: not yet)


class SimPool:
    """The real block pool's accounting and events without memory (``SimSpec.realistic``).

    Blocks are free, held by running requests (a full block once per hash, shared by every request
    that holds it), or cached (ref count 0, hash kept, LRU-evictable). ``events`` collects what the
    real pool would emit: ``("stored", (h,))`` per block cached, ``("removed", hashes)`` per batch evicted.
    """

    def __init__(self, total_blocks: int) -> None:
        self.total = total_blocks
        self.free = total_blocks
        self.cached: OrderedDict[int, None] = OrderedDict()  # LRU first
        self.held: Counter[int] = Counter()  # full blocks held, by hash: how many requests hold each
        self.partial = 0  # held blocks with no hash yet (each request's last, filling block)
        self.events: list[tuple[str, tuple[int, ...]]] = []

    @property
    def used(self) -> int:
        return self.total - self.free - len(self.cached)

    def take(self, n: int) -> None:
        """Allocate ``n`` blocks: free ones first, then the least recently used cached ones (evicted).
        NOTE: a pool that runs out of both over-commits (the simulated worker never preempts)."""
        evicted = []
        for _ in range(n):
            if self.free > 0:
                self.free -= 1
            elif self.cached:
                evicted.append(self.cached.popitem(last=False)[0])
        if evicted:
            self.events.append(("removed", tuple(evicted)))

    def hits(self, hashes: list[int]) -> int:
        """How many leading ``hashes`` are in the pool (held or cached) now."""
        n = 0
        while n < len(hashes) and (hashes[n] in self.held or hashes[n] in self.cached):
            n += 1
        return n

    def hold(self, h: int, fresh: bool) -> None:
        """A request holds full block ``h``: revived from the cache, shared, or (``fresh``) just filled."""
        if h in self.cached:
            del self.cached[h]
        elif fresh and h not in self.held:
            self.events.append(("stored", (h,)))
        self.held[h] += 1

    def release(self, hashes: list[int], partial: bool) -> None:
        """A request ended: its full blocks held by nobody else become cached, its partial one free."""
        for h in hashes:
            self.held[h] -= 1
            if not self.held[h]:
                del self.held[h]
                self.cached[h] = None
        if partial:
            self.partial -= 1
            self.free += 1


class SimWorker:
    """The methods the router calls on a worker (``ready``, ``add_request``, ``check_health``, ...)."""

    def __init__(self, worker_id: str, options: WorkerOptions, spec: SimSpec) -> None:
        self.worker_id, self.options, self.spec = worker_id, options, spec
        self.incarnation = uuid.uuid4().hex
        self.outbox = Outbox(hold_s=options.router_hold_ms / 1000)
        self._lock = threading.Lock()
        self._running: dict[str, _Running] = {}
        self._steps = 0
        self._report_seq = 0
        self._event_seq = 0
        self._pressure = PressurePolicy.from_options(options)
        self._pool = SimPool(spec.total_blocks) if spec.realistic else None
        self._extra = cache_extra("sim", None)
        self._counters = Counter()  # realistic: prefill and prefix-cache token counters of the reports
        self._cached_tokens: dict[str, int] = {}  # realistic: each request's prefix hits, in tokens
        self._stop = threading.Event()
        self.data_links = DataLinks(options, self._hello, _run_now, self._abort_owned)
        self.link = WorkerLinkClient(
            options.router_address or "",
            self.outbox,
            hello=self._hello,
            on_connect=lambda: None,
            on_command=self._on_command,
            credential=options.credential,
            credentials=channel_credentials(options.tls_ca, options.tls_cert, options.tls_key),
        )
        # As a real worker's process does once started (kvserve/workers/transport/worker.py).
        _, self.gc_pauses = settle_heap(f"sim worker {worker_id}")
        self.link.start()
        self._thread = threading.Thread(target=self._run, name="sim-engine", daemon=True)
        self._thread.start()

    def identity(self) -> WorkerIdentity:
        s = self.spec
        return WorkerIdentity(self.worker_id, "sim", s.block_size, s.total_blocks, s.max_model_len, s.vocab_size)

    def _hello(self) -> pb.Hello:
        hello = self.identity().to_hello(self.incarnation)
        hello.takes_adds = True  # as a real worker: the router adds requests on the link (``_on_command``)
        return hello

    def ready(self) -> WorkerIdentity:
        return self.identity()

    def bind_link(self, nonce: str) -> str:
        """As ``Worker.bind_link``: the router's nonce for this process; returns its incarnation."""
        self.link.bind(nonce)
        return self.incarnation

    def add_request(self, request: WorkerRequest) -> None:
        with self._lock:
            self._take(request)

    def _take(self, request: WorkerRequest) -> None:
        """Under ``_lock``: ``request`` runs from the next step."""
        self._running[request.request_id] = _Running(request, len(request.resume_output_ids))

    def add_requests(self, requests: list[WorkerRequest]) -> None:
        """As ``Worker.add_requests``: every one queued (None)."""
        for request in requests:
            self.add_request(request)

    def check_health(self) -> None:
        if not self._thread.is_alive():
            raise RuntimeError(f"simulated worker {self.worker_id}: its step thread died")

    def pid(self) -> int:
        import os

        return os.getpid()

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.data_links.stop()
        self.link.stop()

    def _abort_owned(self, address: str, key: str) -> bool:
        """An owner's Abort (its data link): drop what it knows as ``key``."""
        with self._lock:
            rids = [rid for rid, run in self._running.items()
                    if (run.request.owner, run.request.owner_key) == (address, key)]  # fmt: skip
            for rid in rids:
                self._release(self._running.pop(rid))
        return bool(rids)

    def _on_command(self, cmd: pb.RouterCommand) -> None:
        kind = cmd.WhichOneof("command")
        if kind == "add_requests":  # as ``WorkerCore._add_command``: queued, acked before any output of them
            requests = [request_from_proto(m) for m in cmd.add_requests.requests]
            with self._lock:  # NOTE: a step sees them only after the ack is logged
                for request in requests:
                    self._take(request)
                self.outbox.put(pb.WorkerMessage(ack=pb.CommandAck(command_seq=cmd.seq, ok=True)))
            return
        rid = cmd.abort.request_id if kind == "abort" else ""
        with self._lock:
            run = self._running.pop(rid, None) if kind == "abort" else None
            ok = run is not None if kind == "abort" else kind == "request_snapshot"
            if run is not None:
                self._release(run)
        if kind == "request_snapshot":
            self.outbox.put(pb.WorkerMessage(block_snapshot=pb.BlockSnapshot()))
        self.outbox.put(pb.WorkerMessage(ack=pb.CommandAck(command_seq=cmd.seq, request_id=rid, ok=ok)))

    def _run(self) -> None:
        period = self.spec.step_ms / 1000
        next_step = time.monotonic()
        while not self._stop.is_set():
            next_step += period
            self._stop.wait(max(0.0, next_step - time.monotonic()))
            self._step()

    def _prefill(self, run: _Running) -> None:
        """Realistic: the request's first step holds its prompt's blocks (leading cached ones reused)."""
        pool, prompt, size = self._pool, run.request.prompt, self.spec.block_size
        assert pool is not None
        hashes = hash_blocks(prompt, size, self._extra)
        hits = pool.hits(hashes)
        for i, h in enumerate(hashes):
            if i >= hits:
                pool.take(1)
            pool.hold(h, fresh=i >= hits)
        if len(prompt) % size:
            pool.take(1)
            pool.partial += 1
        run.hashes = hashes
        self._cached_tokens[run.request.request_id] = hits * size
        self._counters["prefill"] += len(prompt) - hits * size
        self._counters["queried"] += len(prompt)
        self._counters["hit"] += hits * size

    def _grow(self, run: _Running, before: int, after: int) -> None:
        """Realistic: tokens ``before`` -> ``after`` of the sequence fill blocks and start new ones."""
        pool, size = self._pool, self.spec.block_size
        assert pool is not None and run.hashes is not None
        for block in range(before // size, after // size):  # filled: the partial block gets its hash
            if block >= len(run.hashes):
                parent = run.hashes[-1] if run.hashes else 0
                run.hashes.append(hash_block(parent, (block,), run.request.request_id))
                pool.partial -= 1
                pool.hold(run.hashes[-1], fresh=True)
        for _ in range(blocks_for(before, size), blocks_for(after, size)):  # started
            pool.take(1)
            pool.partial += 1

    def _release(self, run: _Running) -> None:
        if self._pool is not None and run.hashes is not None:
            held = len(run.request.prompt) + run.emitted
            self._pool.release(run.hashes, partial=held % self.spec.block_size != 0)
            self._cached_tokens.pop(run.request.request_id, None)

    def _final(self, rid: str, new: list[int], text: str, run: _Running, owned: bool = False,
               finished: bool = True) -> pb.RequestOutput:  # fmt: skip
        """An output message of ``run`` (its last, or an owned request's progress: no tokens, ``owned``)."""
        return pb.RequestOutput(
            request_id=rid, new_token_ids=new, text_delta=text, finish_reason="length" if finished else "",
            num_output_tokens=run.emitted, num_prompt_tokens=len(run.request.prompt),
            num_cached_tokens=self._cached_tokens.get(run.request.request_id, 0), owned=owned,
        )  # fmt: skip

    def _pool_events(self, events: list[pb.BlockEvent]) -> None:
        assert self._pool is not None
        for kind, hashes in self._pool.events:
            self._event_seq += 1
            if kind == "stored":
                events.append(pb.BlockEvent(seq=self._event_seq, stored=pb.BlockStored(hashes=hashes)))
            else:
                events.append(pb.BlockEvent(seq=self._event_seq, removed=pb.BlockRemoved(hashes=hashes)))
        self._pool.events.clear()

    def _step(self) -> None:
        k = self.spec.tokens_per_step
        stamp = f"{time.monotonic_ns()};"  # NOTE: ";" keeps stamps apart when responses merge
        outputs, events = [], []
        plain: list[tuple[str, list[int], int]] = []
        owned: dict[str, pb.StepOutputs] = {}  # owner address -> its step (a real worker's ``_route``)
        now = time.monotonic()
        size = self.spec.block_size
        pool = self._pool
        with self._lock:
            for rid, run in list(self._running.items()):
                if pool is not None and run.hashes is None:
                    self._prefill(run)
                n = min(k, run.request.params.max_tokens - run.emitted)
                held = len(run.request.prompt) + run.emitted
                run.emitted += n
                if pool is not None:
                    self._grow(run, held, held + n)
                else:
                    for block in range(held // size, (held + n) // size):
                        self._event_seq += 1
                        stored = pb.BlockStored(hashes=[hash((rid, block)) & (2**64 - 1)])
                        events.append(pb.BlockEvent(seq=self._event_seq, stored=stored))
                done = run.emitted >= run.request.params.max_tokens
                new = [(run.emitted + i) % self.spec.vocab_size for i in range(n)]
                owner = run.request.owner
                if owner:
                    to = owned.setdefault(owner, pb.StepOutputs(decode_step=self._steps + 1))
                    oid = owner_request_id(run.request.owner_key, rid)
                    if done:
                        to.outputs.append(self._final(oid, new, stamp, run))
                    else:
                        append_entry(to.columns, oid, new, run.emitted, stamp)
                    if done or run.progress_at is None or now - run.progress_at >= PROGRESS_INTERVAL_S:
                        run.progress_at = now  # NOTE: what the router gets of it: progress, no tokens
                        outputs.append(self._final(rid, [], "", run, owned=True, finished=done))
                elif done:
                    outputs.append(self._final(rid, new, stamp, run))
                else:  # NOTE: as a real worker sends a plain output (kvserve/workers/transport/worker.py)
                    plain.append((rid, new, run.emitted))
                if done:
                    del self._running[rid]
                    self._release(run)
            running = len(self._running)
            in_flight = sum(len(r.request.prompt) + r.emitted for r in self._running.values())
            if pool is not None:
                self._pool_events(events)
                used, free, evictable = pool.used, pool.free, len(pool.cached)
            else:
                used = sum(blocks_for(len(r.request.prompt) + r.emitted, size) for r in self._running.values())
                free, evictable = self.spec.total_blocks - used, 0
        self._steps += 1
        for address, owner_step in owned.items():
            self.data_links.outbox_for(address).put_step(owner_step, None, None)
        step = None
        if outputs or plain:
            step = pb.StepOutputs(decode_step=self._steps, outputs=outputs)
            for rid, new, total in plain:
                append_entry(step.columns, rid, new, total, stamp)
        total = self.spec.total_blocks
        report = pb.PressureReport(worker_id=self.worker_id, total_blocks=total, free_blocks=free,
                                   used_blocks=used, num_running=running, decode_steps=self._steps,
                                   step_latency_ms=self.spec.step_ms)  # fmt: skip
        if pool is not None:  # NOTE: the fields a real worker fills besides (kvserve/workers/transport/worker.py)
            c = self._counters
            report.cached_evictable_blocks = evictable
            report.tokens_in_flight = in_flight
            report.prefill_tokens_total = c["prefill"]
            report.prefix_cache_query_tokens_total = c["queried"]
            report.prefix_cache_hit_tokens_total = c["hit"]
        now = time.monotonic()
        pressure = None
        if self._pressure.due(now, report):
            self._report_seq += 1
            report.seq = self._report_seq
            pressure = report
        if self.outbox.put_step(step, pb.BlockEvents(events=events) if events else None, pressure):
            self._pressure.sent(now, report)


def sim_worker_actor_class():
    """``ray.remote(SimWorker)`` (Ray is imported only here)."""
    import ray

    return ray.remote(num_cpus=0, max_concurrency=64)(SimWorker)


def _run_now(fn: Callable[[], Any]) -> Future:
    """What a real worker's inbox does for an owner's command, at once (the simulated worker has no engine
    thread to wait for: its state is under its lock)."""
    fut: Future = Future()
    try:
        fut.set_result(fn())
    except Exception as e:  # noqa: BLE001 - the caller gets the exception
        fut.set_exception(e)
    return fut
