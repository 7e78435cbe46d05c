"""ClusterConfig: everything ``kvserve serve`` needs, from a YAML file and/or flags, validated once.

A ``cluster.yaml`` holds top-level keys (where Ray is, how many workers, where the API and metrics
listen) and three sections whose keys are exactly the fields of the frozen configs they build::

    model: /models/llama-3-8b         # HF directory, on every node
    address: auto                     # null = start a local Ray; "auto" or HOST:PORT = join one
    workers: auto                     # N, or "auto" = one per GPU (2 CPU workers without GPUs)
    host: 0.0.0.0
    port: 50051                       # gRPC client API + WorkerLink (0 = pick a free port)
    worker_link_address: null         # HOST:PORT workers dial for the WorkerLink (a proxy; null = the router's)
    metrics_port: 9400                # Prometheus /metrics on the router host (null = off)
    http_port: null                   # OpenAI-compatible HTTP API (null = off, 0 = a free port)
    frontends: 0                      # stateless frontends serving the client APIs (0 = the router does)
    frontend_port: 50052              # their shared gRPC port (SO_REUSEPORT; 0 = a free port)
    cpus_per_worker: 1                # CPU workers: Ray CPUs and torch threads per worker
    spread: false                     # place workers on distinct nodes (placement group, SPREAD)
    ready_timeout_s: 600              # how long to wait for every worker's Hello
    engine: {block_size: 16, preemption_mode: auto, swap_space: 4}       # EngineConfig
    router: {placement_policy: kv_aware, max_queue_requests: 1024}       # RouterConfig
    worker: {pressure_interval_ms: 50}                                   # WorkerOptions

``model``, ``host`` and ``port`` live only at the top level (the engine and router get them from
there); the router's address and auth token reach the workers from the router, so the ``worker``
section cannot set them. Unknown keys and bad values raise ``ValueError`` naming the key, e.g.
``engine.block_size: must be a positive power of two, got 12``. Flags override the file
(``ClusterConfig.load(path, overrides)``), the file overrides the defaults.

Each key's default, help and check are declared once, on its dataclass field (``knob(...)``,
``kvserve/workers/core/knobs.py``); this module only composes the sections, checks YAML types and names the
key in errors. ``kvserve serve`` generates one flag per key from the same fields
(``kvserve/cluster/serve_cli.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvserve.router.config import RouterConfig
from kvserve.workers.core.knobs import knob
from kvserve.workers.engine.config import EngineConfig
from kvserve.workers.transport.options import WorkerOptions

# Ray names (docs/architecture.md: the router is a detached, named actor so `kvserve status` can find it).
RAY_NAMESPACE = "kvserve"
ROUTER_ACTOR_NAME = "kvserve-router"

# Section keys that only the top level (or the launcher) sets.
_RESERVED = {
    "engine": {"model": "model"},
    "router": {"model": "model", "host": "host", "port": "port", "stall_timeout_s": "worker.stall_timeout_s"},
    "worker": {"router_address": None, "credential": None, "data_credential": None},
}
_SECTIONS = {"engine": EngineConfig, "router": RouterConfig, "worker": WorkerOptions}


# ---- command-line text -> top-level values ------------------------------------------------------
def _workers_arg(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {text!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {text!r}")
    return n


def _address_arg(text: str) -> str | None:
    return None if text in ("local", "") else text


def _metrics_port_arg(text: str) -> int | None:
    if text.lower() in ("off", "none"):
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number or 'off', got {text!r}") from None


@dataclass(frozen=True)
class ClusterConfig:
    """A serving cluster: where it runs and every component's config.

    Attributes:
        model: HF model directory (the same path on every node).
        address: Ray address to join ("auto", "HOST:PORT"); None starts a local Ray.
        workers: worker actors, or "auto" (one per GPU; 2 CPU workers on a machine without GPUs).
        port: the router's gRPC port (0 = pick a free one).
        metrics_port: Prometheus ``/metrics`` port on the router host; None = off, 0 = pick a free one.
        http_port: the OpenAI-compatible HTTP API's port on the router host; None = off (the
            default: a second API port is a deliberate choice), 0 = pick a free one.
        frontends: stateless frontend processes on the router's node serving the client gRPC API on
            ``frontend_port`` and the HTTP API on ``http_port`` (both shared with SO_REUSEPORT),
            relayed to the router (``frontend/``); 0 = none: the router serves both APIs itself.
        frontend_port: the frontends' shared gRPC port (0 = pick a free one).
        host: the router's bind address (API, WorkerLink and metrics).
        worker_link_address: where the workers dial the router's WorkerLink when that is not the
            router's own address (a TCP proxy or load balancer in front of it; the chaos tests' relay).
        cpus_per_worker: Ray CPUs (and torch threads) per CPU worker.
        spread: put workers on distinct nodes where possible (placement group, SPREAD).
        ready_timeout_s: how long to wait for every worker to say Hello.
        engine / router / worker: the component configs; ``model``/``host``/``port`` are filled in
            from the top level.

    Raises:
        ValueError: a bad value, naming its key.
    """

    model: str = knob(help="HF model directory (the same path on every node)")
    address: str | None = knob(
        None, help="Ray to join: auto | HOST:PORT (default: start a local Ray; 'local' on the CLI)", parse=_address_arg
    )
    workers: int | str = knob(
        "auto", help="N | auto (default: one per GPU, else 2 CPU workers)", parse=_workers_arg
    )
    port: int = knob(50051, help="gRPC port of the API and WorkerLink (0 = pick a free one)")
    metrics_port: int | None = knob(9400, help="Prometheus /metrics port (0 = free; off)", parse=_metrics_port_arg)
    http_port: int | None = knob(
        None, help="OpenAI-compatible HTTP API port (default: off; 0 = free; off)", parse=_metrics_port_arg
    )
    frontends: int = knob(0, help="stateless frontend processes serving the client APIs (0 = the router does)")
    frontend_port: int = knob(50052, help="the frontends' shared gRPC port (0 = pick a free one)")
    host: str = knob("127.0.0.1", help="bind address of the API and metrics")
    worker_link_address: str | None = knob(
        None, help="HOST:PORT the workers dial for the router's WorkerLink (a TCP proxy in front of it; "
        "default: the router's own address)"
    )
    cpus_per_worker: int = knob(1, help="Ray CPUs and torch threads per CPU worker")
    spread: bool = knob(False, help="place workers on distinct nodes (placement group SPREAD)")
    ready_timeout_s: float = knob(600.0, help="seconds to wait for every worker's Hello", flag="--ready-timeout")
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(model=""))
    router: RouterConfig = field(default_factory=RouterConfig)
    worker: WorkerOptions = field(default_factory=WorkerOptions)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model: required (a HuggingFace model directory)")
        if self.address is not None and not (self.address == "auto" or _is_host_port(self.address)):
            raise ValueError(f"address: must be null (start a local Ray), 'auto' or HOST:PORT, got {self.address!r}")
        if self.workers != "auto" and not (_is_int(self.workers) and self.workers > 0):
            raise ValueError(f"workers: must be a positive integer or 'auto', got {self.workers!r}")
        _check_port("port", self.port)
        _check_port("frontend_port", self.frontend_port)
        if not (_is_int(self.frontends) and self.frontends >= 0):
            raise ValueError(f"frontends: must be an integer >= 0, got {self.frontends!r}")
        if self.metrics_port is not None:
            _check_port("metrics_port", self.metrics_port)
        if self.http_port is not None:
            _check_port("http_port", self.http_port)
        if self.worker_link_address is not None and not _is_host_port(self.worker_link_address):
            raise ValueError(f"worker_link_address: must be HOST:PORT, got {self.worker_link_address!r}")
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host: must be a non-empty string, got {self.host!r}")
        if not (_is_int(self.cpus_per_worker) and self.cpus_per_worker > 0):
            raise ValueError(f"cpus_per_worker: must be a positive integer, got {self.cpus_per_worker!r}")
        if not isinstance(self.spread, bool):
            raise ValueError(f"spread: must be true or false, got {self.spread!r}")
        if (
            isinstance(self.ready_timeout_s, bool)
            or not isinstance(self.ready_timeout_s, int | float)
            or (self.ready_timeout_s <= 0)
        ):
            raise ValueError(f"ready_timeout_s: must be a positive number, got {self.ready_timeout_s!r}")
        if self.engine.model not in ("", self.model):
            raise ValueError(f"engine.model ({self.engine.model!r}) differs from model ({self.model!r})")
        # The top level is the one source of model/host/port.
        object.__setattr__(self, "engine", dataclasses.replace(self.engine, model=self.model))
        # The liveness rule's stall timeout is one knob for workers and router (worker.stall_timeout_s).
        router = dataclasses.replace(
            self.router, model=self.model, host=self.host, port=self.port, stall_timeout_s=self.worker.stall_timeout_s
        )
        object.__setattr__(self, "router", router)

    # ---- loading ---------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ClusterConfig:
        """Build from a mapping shaped like ``cluster.yaml``; ValueError names the offending key."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a cluster config must be a mapping of keys, got {type(data).__name__}")
        top = {f.name: f for f in dataclasses.fields(cls) if f.name not in _SECTIONS}
        unknown = [k for k in data if k not in top and k not in _SECTIONS]
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown key (known: {', '.join(sorted([*top, *_SECTIONS]))})")
        kwargs: dict[str, Any] = {}
        for name, value in data.items():
            if name in _SECTIONS:
                kwargs[name] = _build_section(name, value, top_level=data)
            else:
                kwargs[name] = value if name == "workers" else _check_type(name, top[name].type, value)
        if "model" not in kwargs:
            raise ValueError("model: required (a HuggingFace model directory)")
        return cls(**kwargs)

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> ClusterConfig:
        """``path`` (YAML; None = none) with ``overrides`` (same shape, e.g. from flags) on top."""
        data = read_yaml(path) if path is not None else {}
        try:
            return cls.from_dict(merge(data, overrides or {}))
        except ValueError as e:
            raise ValueError(f"{path}: {e}" if path is not None else str(e)) from None

    def to_dict(self) -> dict[str, Any]:
        """The YAML shape (round-trips through ``from_dict``)."""
        out: dict[str, Any] = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _SECTIONS
        }
        for name in _SECTIONS:
            section = dataclasses.asdict(getattr(self, name))
            for key in _RESERVED[name]:
                section.pop(key, None)
            out[name] = section
        return out

    # ---- derived ---------------------------------------------------------------------------
    def num_workers(self, num_gpus: int) -> int:
        """Workers to start on a Ray cluster with ``num_gpus`` GPUs."""
        if self.workers != "auto":
            return int(self.workers)
        # NOTE: a tensor-parallel worker takes tensor_parallel_size GPUs (kvserve/workers/parallel)
        tp = self.engine.tensor_parallel_size
        return max(1, num_gpus // tp) if num_gpus >= 1 and self.use_gpus(num_gpus) else 2

    def use_gpus(self, num_gpus: int) -> bool:
        """One GPU per worker: when the engine device asks for CUDA, or (device auto) the cluster has GPUs."""
        if self.engine.device.startswith("cuda"):
            return True
        return self.engine.device == "auto" and num_gpus >= 1

    def worker_options(self) -> WorkerOptions:
        """The workers' options, with WorkerLink TLS defaulting to the router's certificate.

        NOTE: with a self-signed router certificate the certificate is its own CA; with mTLS
        (``router.tls_client_ca``) the workers present the router's own key pair unless the
        ``worker`` section names another. Set ``worker.tls_*`` for a CA-issued setup.
        """
        w, r = self.worker, self.router
        if r.tls_cert and not w.tls_ca:
            w = dataclasses.replace(w, tls_ca=r.tls_cert)
        if r.tls_client_ca and not w.tls_cert:
            w = dataclasses.replace(w, tls_cert=r.tls_cert, tls_key=r.tls_key)
        return w


# ---- helpers ---------------------------------------------------------------------------------
def read_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML mapping from ``path`` (an empty file is ``{}``); ValueError on anything else."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as e:
        raise ValueError(f"{p}: cannot read: {e.strerror or e}") from e
    except yaml.YAMLError as e:
        raise ValueError(f"{p}: not valid YAML: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{p}: expected a mapping of keys at the top level, got {type(data).__name__}")
    return data


def merge(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` on top, recursing into nested mappings (sections)."""
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def _build_section(name: str, value: Any, top_level: Mapping[str, Any]) -> Any:
    cls = _SECTIONS[name]
    if value is None:
        value = {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{name}: expected a mapping of {cls.__name__} fields, got {value!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, v in value.items():
        if key in _RESERVED[name]:
            where = _RESERVED[name][key]
            hint = "the launcher sets it"
            if where:
                hint = f"set it as '{where}'" if "." in where else f"set it at the top level as '{where}'"
            raise ValueError(f"{name}.{key}: not allowed in this section ({hint})")
        if key not in fields:
            known = ", ".join(sorted(k for k in fields if k not in _RESERVED[name]))
            raise ValueError(f"{name}.{key}: unknown key (known: {known})")
        kwargs[key] = _check_type(f"{name}.{key}", fields[key].type, v)
    if name == "engine":
        kwargs["model"] = top_level.get("model") or ""
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise ValueError(_name_key(name, str(e), fields)) from None


def _name_key(section: str, message: str, fields: Mapping[str, Any]) -> str:
    """'block_size must be ...' from EngineConfig -> 'engine.block_size: must be ...'."""
    first = message.split(" ", 1)
    key = first[0].removesuffix(":")
    if key in fields and len(first) == 2 and (first[1].startswith("must ") or first[0].endswith(":")):
        return f"{section}.{key}: {first[1]}"
    mentions = [(m.start(), key) for key in fields if (m := re.search(rf"\b{re.escape(key)}\b", message))]
    if mentions:  # the field the message mentions first
        return f"{section}.{min(mentions)[1]}: {message}"
    return f"{section}: {message}"


_TYPE_WORDS = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false", "None": "null"}


def _check_type(key: str, annotation: Any, value: Any) -> Any:
    """``value`` if it fits the field's annotation (e.g. ``"int | None"``), else ValueError naming ``key``.

    Numbers given as strings where a float is expected are converted (PyYAML reads ``1e-3`` as text).
    """
    names = [t.strip() for t in str(annotation).split("|")]
    if not set(names) <= set(_TYPE_WORDS):
        return value  # an annotation this checker does not know: the dataclass validates it
    if value is None and "None" in names:
        return value
    if isinstance(value, bool):
        if "bool" in names:
            return value
    elif isinstance(value, int) and ("int" in names or "float" in names):
        return value
    elif isinstance(value, float) and "float" in names:
        return value
    elif isinstance(value, str) and "str" in names:
        return value
    elif isinstance(value, str) and "float" in names:
        try:
            return float(value)
        except ValueError:
            pass
    expected = " or ".join(_TYPE_WORDS[n] for n in names)
    raise ValueError(f"{key}: expected {expected}, got {value!r}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_port(key: str, port: Any) -> None:
    if not (_is_int(port) and 0 <= port < 65536):
        raise ValueError(f"{key}: must be an integer in [0, 65535], got {port!r}")


def _is_host_port(address: str) -> bool:
    host, sep, port = address.rpartition(":")
    return bool(sep and host and port.isdigit())
