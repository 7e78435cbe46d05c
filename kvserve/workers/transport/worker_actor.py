"""The worker's Ray actor: ``Worker`` around ``WorkerCore`` (kvserve/workers/transport/worker.py).

NOTE: a module of its own that imports no engine (no torch) at its top: every process that unpickles a
worker's actor handle loads this actor class from Ray's GCS, the router among them (it is handed each worker's
handle at registration). Defined beside ``WorkerCore``, the router imported torch and the whole engine on
its event loop there: seconds of a router restart on a busy node (README "Failure behaviour"). The engine is
imported in ``__init__``, in the worker's own process.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import TYPE_CHECKING, Any

from kvserve.workers.core.gc_pauses import settle_heap

if TYPE_CHECKING:
    from kvserve.protos.kvserve.v1 import worker_pb2 as pb
    from kvserve.workers.core.identity import WorkerIdentity
    from kvserve.workers.core.request import WorkerRequest
    from kvserve.workers.engine.config import EngineConfig
    from kvserve.workers.engine.migration import MigrationState
    from kvserve.workers.transport.options import WorkerOptions

logger = logging.getLogger(__name__)


class Worker:
    """The Ray actor around ``WorkerCore`` (create it with ``worker_actor_class()``).

    Methods only enqueue into the engine inbox or read snapshots, so the actor runs threaded
    (``max_concurrency`` > 1): a slow call never blocks ``stats`` or ``check_health``.
    """

    def __init__(
        self,
        worker_id: str,
        engine_config: EngineConfig,
        options: WorkerOptions | None = None,
        num_threads: int | None = None,
    ) -> None:
        if num_threads:
            import torch

            torch.set_num_threads(num_threads)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        from kvserve.workers.transport.worker import WorkerCore  # NOTE: the engine, torch: see the module docstring

        self.core = WorkerCore(worker_id, engine_config, options)
        # NOTE: here, not in WorkerCore: this process is the worker's alone (tests run WorkerCore in
        # theirs). The model is loaded and warmed: what exists now lives as long as the process.
        _, self.gc_pauses = settle_heap(f"worker {worker_id}")
        self.core.start()
        self._drain_on_sigterm()

    def _drain_on_sigterm(self) -> None:
        """SIGTERM = drain this worker (README "Failure behaviour").

        NOTE: Ray's own handler in an actor process raises SystemExit: the process dies as a
        system error, Ray restarts it, and the router sees a crash (its requests replayed, the
        restart counted toward retirement). Instead the first SIGTERM asks the router to drain
        this worker, which restarts the process itself once its requests moved away; Ray's
        handler is put back, so a second SIGTERM exits at once. Ray runs an actor's ``__init__``
        on the process's main thread, the only one that may set a handler (checked).
        """
        if threading.current_thread() is not threading.main_thread():
            logger.warning("worker %s: not on the main thread: SIGTERM keeps Ray's default", self.core.worker_id)
            return
        previous = signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum: int, frame: Any) -> None:
            signal.signal(signal.SIGTERM, previous)
            # NOTE: off the signal handler: it interrupts the main thread wherever it is.
            threading.Thread(target=self.core.request_drain, args=("SIGTERM",), daemon=True).start()

        signal.signal(signal.SIGTERM, on_sigterm)

    def ready(self) -> WorkerIdentity:
        """Identity and sizes (what the WorkerLink Hello says), once the engine is up."""
        return self.core.identity()

    def add_request(self, request: WorkerRequest) -> None:
        """Queue a request; with ``resume_output_ids`` continue one after those output tokens
        (failover replay: the router passes what it already streamed)."""
        self.core.add_request(request)

    def add_requests(self, requests: list[WorkerRequest]) -> list[tuple[str, str] | None] | None:
        """Several ``add_request`` in one call (a burst the router placed here): None when all were queued,
        else per request None or why it was refused (``WorkerCore.add_requests``)."""
        return self.core.add_requests(requests)

    def abort(self, request_id: str) -> bool:
        return self.core.abort(request_id)

    def preempt(self, request_id: str, mode: str | None = None) -> bool:
        return self.core.preempt(request_id, mode)

    def export_request(self, request_id: str) -> MigrationState | None:
        return self.core.export_request(request_id)

    def export_for_migration(self, request_id: str) -> tuple[int | None, MigrationState | None]:
        """``export_request`` as two returns (call it with ``.options(num_returns=2)``): the tokens the state covers
        (None: nothing was exported) and the state. The caller owns both: the router awaits the count only and
        hands the state's reference to the destination's ``import_request`` unread, so the KV goes from this
        node's object store to the destination without the router deserializing it, and outlives this process
        (docs/architecture.md section 2, "Migration")."""
        state = self.core.export_request(request_id)
        return (None, None) if state is None else (state.num_tokens, state)

    def finish_export(self, request_id: str, migrated: bool) -> bool:
        return self.core.finish_export(request_id, migrated)

    def import_request(self, state: MigrationState) -> bool | None:
        return self.core.import_request(state)

    def stats(self) -> pb.PressureReport:
        return self.core.stats()

    def check_health(self) -> None:
        self.core.check_health()

    def check_integrity(self) -> None:
        """Block-pool invariants, checked on the engine thread (tests)."""
        self.core._call(self.core.engine.check_integrity)

    def pid(self) -> int:
        """This actor's OS process id (chaos tests kill it; operators correlate it with logs)."""
        return os.getpid()

    def incarnation(self) -> str:
        """This process's incarnation (its Hello's): the router tells a live process whose link
        broke from one Ray has restarted."""
        return self.core.incarnation

    def bind_link(self, nonce: str) -> str:
        """The router's one-time nonce for this process (kvserve/workers/core/worker_credential.py):
        its WorkerLink proves it from the next connect on. Returns this process's incarnation, the
        one the nonce is now bound to. Only a holder of this actor's handle (inside Ray) can call it."""
        if self.core.link is not None:
            self.core.link.bind(nonce)
        return self.core.incarnation

    def shutdown(self) -> None:
        self.core.stop()


def worker_actor_class(max_concurrency: int = 32, actor: type[Worker] = Worker):
    """``ray.remote(actor)`` with threaded concurrency; Ray is imported only here.

    ``actor`` is ``Worker`` or a subclass of it: tests start one that can also inject faults
    (``tests/integration/fault_worker.py``), with the same actor options as production."""
    import ray

    return ray.remote(max_concurrency=max_concurrency)(actor)
