"""RouterConfig: the router's knobs, validated once, frozen."""

from __future__ import annotations

from dataclasses import dataclass

from router.placement import PlacementPolicy


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"  # NOTE: loopback by default; serving beyond it is a deliberate choice
    port: int = 50051  # client API and WorkerLink (0 = pick a free port)
    model: str = ""  # model directory, for the tokenizer (text prompts)
    auth_token: str | None = None
    tls_cert: str | None = None  # PEM server certificate
    tls_key: str | None = None
    tls_client_ca: str | None = None  # PEM CA: require client certificates (mTLS)
    max_message_bytes: int = 16 << 20
    placement_policy: str = PlacementPolicy.KV_AWARE.value
    max_queue_requests: int = 1024
    max_queue_blocks: int = 1 << 20
    # A request is queued only if its projected start is within this (and its own deadline).
    max_queue_wait_s: float = 30.0
    default_max_tokens: int = 256
    # Cluster-level pressure: migrate off a worker above high while another is below low.
    high_watermark: float = 0.9
    low_watermark: float = 0.6
    enable_migration: bool = True
    enable_priority_preemption: bool = True
    stale_report_s: float = 5.0  # no pressure report for this long -> unhealthy
    health_check_interval_s: float = 2.0

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        PlacementPolicy(self.placement_policy)  # raises ValueError naming the bad policy
        if not 0.0 <= self.low_watermark <= self.high_watermark <= 1.0:
            raise ValueError("need 0 <= low_watermark <= high_watermark <= 1")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("tls_client_ca (mTLS) needs tls_cert and tls_key")
        for name in (
            "max_message_bytes", "default_max_tokens", "stale_report_s", "health_check_interval_s", "max_queue_wait_s"
        ):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.max_queue_requests < 0 or self.max_queue_blocks < 0:
            raise ValueError("queue limits must be >= 0")
