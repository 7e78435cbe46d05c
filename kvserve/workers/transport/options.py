"""WorkerOptions: a worker's knobs beside its engine's, declared and validated here only.

The ``worker:`` section of ``cluster.yaml`` and the ``--worker-*`` flags of ``kvserve serve`` are
generated from these fields (``kvserve/workers/core/knobs.py``).

NOTE: a leaf module apart from ``kvserve/workers/transport/worker.py`` so the launcher and the config loader can
name the options without importing the worker (torch, grpc).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.workers.core.knobs import NON_NEGATIVE, POSITIVE, knob, validate


@dataclass(frozen=True)
class WorkerOptions:
    """Worker knobs beside the engine's.

    Raises:
        ValueError: a bad value, ``"<field> must be ..., got <value>"``.
    """

    router_address: str | None = knob(None, help="host:port of the router's WorkerLink (None = no link)", cli=False)
    credential: str | None = knob(None, help="this worker's WorkerLink credential (the launcher issues it)", cli=False)
    data_credential: str | None = knob(
        None, help="this worker's data-link credential, for its owners' data services (the launcher issues it)",
        cli=False,
    )  # fmt: skip
    tls_ca: str | None = knob(None, help="PEM: trust this CA for the router's certificate")
    tls_cert: str | None = knob(None, help="PEM: client certificate (mTLS)")
    tls_key: str | None = knob(None, help="PEM: client key (mTLS)")
    pressure_interval_ms: float = knob(50.0, help="most frequent pressure report, ms", check=NON_NEGATIVE)
    idle_report_s: float = knob(1.0, help="pressure report interval when nothing changes, s", check=POSITIVE)
    # NOTE: 20 ms: the router then reads at most ~50 messages a second per worker whatever the step rate
    # (issue 41); a finish reaches the router's admission at most this late, as pressure does by
    # pressure_interval_ms. Clients' tokens never wait: owned ones go to the frontends, router-owned ones at once.
    router_hold_ms: float = knob(
        20.0, help="most an owned request's progress, block events and pressure wait to go to the router together, ms",
        check=NON_NEGATIVE,
    )  # fmt: skip
    high_watermark: float = knob(0.9, help="report at once when pool usage crosses this")
    low_watermark: float = knob(0.7, help="report at once when pool usage crosses this")
    # NOTE: 5 s: a few seconds above the slowest step we expect by default (~1 s: a full
    # 8192-token prefill chunk of an 8B model on one GPU; the tiny test models step in ms on a
    # loaded 2-core box), so a hang is caught and its streams continue within the README's 10 s;
    # a deployment with slower steps is covered by the threshold growing with the slowest step seen
    # (kvserve/workers/core/liveness.py), or raises this.
    stall_timeout_s: float = knob(
        5.0, help="no engine step for this long with work pending = stalled worker (killed, work replayed)",
        check=POSITIVE,
    )  # fmt: skip
    orphan_timeout_s: float = knob(
        10.0, help="abort every request after this long without a router (its clients are gone)", check=POSITIVE
    )

    def __post_init__(self) -> None:
        validate(self)
        if not 0.0 <= self.low_watermark <= self.high_watermark <= 1.0:
            raise ValueError("need 0 <= low_watermark <= high_watermark <= 1")
