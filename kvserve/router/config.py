"""RouterConfig: the router's knobs, declared, documented and validated here only.

The ``router:`` section of ``cluster.yaml`` and the router flags of ``kvserve serve`` are
generated from these fields (``kvserve/workers/core/knobs.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.router.policy.placement import PlacementPolicy
from kvserve.router.policy.placement.scorers import SCORERS, parse_weights
from kvserve.workers.core.knobs import FRACTION, NON_NEGATIVE, PORT, POSITIVE, knob, validate


@dataclass(frozen=True)
class RouterConfig:
    """The router's knobs; ``host``, ``port`` and ``model`` come from the cluster's top level.

    Raises:
        ValueError: a bad value, ``"<field> must be ..., got <value>"``, or a broken pairing rule.
    """

    # NOTE: loopback by default; serving beyond it is a deliberate choice
    host: str = knob("127.0.0.1", help="bind address of the API and WorkerLink", cli=False)
    port: int = knob(50051, help="client API and WorkerLink port (0 = pick a free port)", check=PORT, cli=False)
    model: str = knob("", help="model directory, for the tokenizer (text prompts)", cli=False)
    served_model_name: str = knob(
        "", help="the model's name in the HTTP API (/v1/models, the 'model' field); default: the --model argument"
    )
    auth_token: str | None = knob(None, help="require 'authorization: Bearer TOKEN'", env="KVSERVE_AUTH_TOKEN")
    auth_keys: str | None = knob(
        None, help="YAML/JSON file of sha256-hashed API keys -> tenant, max_priority, rate limits (gate/tenancy.py)",
        env="KVSERVE_AUTH_KEYS",
    )
    metrics_auth: bool = knob(
        False, help="require the client API's bearer token (or an API key) on /metrics too", flag="--metrics-auth"
    )
    tls_cert: str | None = knob(None, help="PEM server certificate (TLS)")
    tls_key: str | None = knob(None, help="PEM server key")
    tls_client_ca: str | None = knob(None, help="PEM CA: require client certificates (mTLS)")
    max_message_bytes: int = knob(16 << 20, help="largest gRPC message", check=POSITIVE)
    placement_policy: str = knob(
        PlacementPolicy.KV_AWARE.value, help="where a request goes", choices=[p.value for p in PlacementPolicy]
    )
    placement_scorers: str | None = knob(
        None, help=f"kv_aware's scorers and weights as NAME=WEIGHT,... (names: {', '.join(SCORERS)}; "
        "default prefix_affinity=2,backlog=1,pool_usage=0.5)",
    )
    max_queue_requests: int = knob(
        1024, help="requests queued at the router before RESOURCE_EXHAUSTED", check=NON_NEGATIVE
    )
    max_queue_blocks: int = knob(1 << 20, help="KV blocks the queued requests may need", check=NON_NEGATIVE)
    max_queue_wait_s: float = knob(
        30.0, help="queue a request only if its projected start is within this (and its own deadline)", check=POSITIVE
    )
    default_max_tokens: int = knob(256, help="max_tokens of a request that gives none", check=POSITIVE)
    # Cluster-level pressure: migrate off a worker above high while another is below low.
    high_watermark: float = knob(0.9, help="migrate off a worker whose pool usage is above this", check=FRACTION)
    low_watermark: float = knob(0.6, help="... onto a worker whose pool usage is below this", check=FRACTION)
    enable_migration: bool = knob(True, help="never migrate requests between workers", flag="--no-migration")
    enable_priority_preemption: bool = knob(
        True, help="never preempt running work for a higher-priority request", flag="--no-priority-preemption"
    )
    stale_report_s: float = knob(
        5.0, help="no pressure report or step heartbeat for this long = unhealthy worker", check=POSITIVE
    )
    # The liveness rule (kvserve/router/table/liveness.py). ``stall_timeout_s`` is the workers' own
    # (``worker.stall_timeout_s``, ``--worker-stall-timeout-s``): the launcher copies it here.
    stall_timeout_s: float = knob(5.0, help="a worker with work and no step for this long is down", check=POSITIVE,
                                  cli=False)  # fmt: skip
    link_grace_s: float = knob(
        2.0, help="a worker whose WorkerLink stays down longer than this is down (shorter: it resumes)", check=POSITIVE
    )
    owner_grace_s: float = knob(
        10.0, help="how long a frontend's placed requests outlive its broken router stream (it re-opens meanwhile)",
        check=POSITIVE,
    )
    # NOTE: keepalive on the router's gRPC server: a client or worker whose TCP peer vanished
    # without a FIN or RST (its host lost power, a partition) is noticed within time + timeout,
    # and its stream ends (a WorkerLink: the link-grace rule takes over; a client: its request is
    # cancelled and its blocks freed). The interval is well above the cost of a ping and below the
    # idle timeouts of common load balancers and NATs (~60 s and up).
    keepalive_s: float = knob(10.0, help="ping a silent gRPC peer (client or worker) after this long", check=POSITIVE)
    keepalive_timeout_s: float = knob(
        5.0, help="close a gRPC connection whose peer has not answered a ping within this", check=POSITIVE
    )
    http_default_timeout_s: float = knob(
        600.0, help="deadline of an HTTP request (the OpenAI API has none of its own): then it ends with a "
                    "timeout error, its blocks freed", check=POSITIVE,
    )  # fmt: skip
    health_check_interval_s: float = knob(2.0, help="how often worker health is checked", check=POSITIVE)
    migration_limit: int = knob(
        3, help="failover replays per request when its worker dies; then UNAVAILABLE", check=NON_NEGATIVE
    )
    max_buffered_responses: int = knob(
        256, help="responses a client may leave unread before its request is aborted", check=POSITIVE
    )
    worker_restart_limit: int = knob(
        3, help="restarts of one worker within worker_restart_window_s before it stays down", check=NON_NEGATIVE
    )
    worker_restart_window_s: float = knob(300.0, help="window of worker_restart_limit, s", check=POSITIVE)
    # Circuit breaking (kvserve/router/table/breaker.py): consecutive failed dispatches take a worker out of placement.
    breaker_failures: int = knob(
        3, help="consecutive failed dispatches (add_request, migration import) that open a worker's breaker",
        check=POSITIVE,
    )
    breaker_backoff_s: float = knob(1.0, help="first time out of placement once the breaker opens, s", check=POSITIVE)
    breaker_max_backoff_s: float = knob(
        30.0, help="the breaker's backoff doubles each time it reopens, up to this (or breaker_backoff_s), s",
        check=POSITIVE,
    )
    # Graceful drain (kvserve/router/requests/drain.py; `kvserve drain`, `kvserve rollout`, SIGTERM to a worker).
    drain_deadline_s: float = knob(
        30.0, help="longest a drained worker's requests may take to move away (a drain that gives none)",
        check=POSITIVE,
    )
    drain_restart_timeout_s: float = knob(
        300.0, help="longest a drained worker may take to come back (restart, model load, Hello)", check=POSITIVE
    )
    # Input bounds (kvserve/router/gate/limits.py, README "Security"): one client cannot stall the router's loop.
    max_http_body_bytes: int = knob(8 << 20, help="largest HTTP request body (413 beyond)", check=POSITIVE)
    max_choices_per_request: int = knob(
        64, help="prompts x n of one HTTP completion call (400 beyond)", check=POSITIVE
    )
    max_stop_token_ids: int = knob(256, help="stop_token_ids of one request", check=POSITIVE)
    max_logprob_tokens: int = knob(
        1 << 16, help="(logprobs + 1) x max_tokens of one request: log-probabilities it may return", check=POSITIVE
    )
    max_streams_per_client: int = knob(
        256, help="requests one client (peer host) may have running or queued at once", check=POSITIVE
    )
    max_pressure_watchers: int = knob(64, help="WatchBlockPressure streams open at once", check=POSITIVE)
    prompt_threads: int = knob(2, help="processes that tokenize/render prompts off the loop+GIL", check=POSITIVE)
    max_pending_prompts: int = knob(256, help="prompts waiting for those threads (beyond: RESOURCE_EXHAUSTED)",
                                    check=POSITIVE)  # fmt: skip

    def placement_weights(self) -> dict[str, float] | None:
        """``placement_scorers`` parsed (None: the policy's default set)."""
        return None if self.placement_scorers is None else parse_weights(self.placement_scorers)

    def tls_files(self) -> tuple[str, str, str | None] | None:
        """``(cert, key, client CA or None)`` when the client ports serve TLS, else None."""
        return (self.tls_cert, self.tls_key, self.tls_client_ca) if self.tls_cert and self.tls_key else None

    def __post_init__(self) -> None:
        validate(self)
        if not 0.0 <= self.low_watermark <= self.high_watermark <= 1.0:
            raise ValueError("need 0 <= low_watermark <= high_watermark <= 1")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together")
        if self.metrics_auth and not (self.auth_token or self.auth_keys):
            raise ValueError("metrics_auth needs auth_token or auth_keys")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("tls_client_ca (mTLS) needs tls_cert and tls_key")
        if self.placement_scorers is not None:
            parse_weights(self.placement_scorers)  # NOTE: refused at start-up, not at the first request
