"""ClusterConfig: YAML loading, validation errors that name the key, flags over the file."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvserve.cluster.cli import build_parser
from kvserve.cluster.config import ClusterConfig, merge, read_yaml
from kvserve.cluster.serve_cli import UNSET, config_from_args, overrides_from_args

FULL_YAML = """
model: /models/llama
address: auto
workers: 4
port: 50052
metrics_port: 9401
host: 0.0.0.0
cpus_per_worker: 2
spread: true
ready_timeout_s: 120
engine:
  block_size: 32
  num_gpu_blocks: 512
  kv_cache_memory: 1GiB
  preemption_mode: auto
  swap_space: 1e-3          # PyYAML reads this as a string: converted for float fields
  enable_prefix_caching: false
router:
  placement_policy: least_loaded
  max_queue_requests: 64
  auth_token: s3cret
worker:
  pressure_interval_ms: 25
  stall_timeout_s: 60
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "cluster.yaml"
    p.write_text(text)
    return p


def parse_serve(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_full_yaml_builds_every_component(tmp_path: Path) -> None:
    cfg = ClusterConfig.load(write(tmp_path, FULL_YAML))
    assert (cfg.model, cfg.address, cfg.workers, cfg.port, cfg.metrics_port, cfg.host) == (
        "/models/llama", "auto", 4, 50052, 9401, "0.0.0.0",
    )  # fmt: skip
    assert cfg.cpus_per_worker == 2 and cfg.spread is True and cfg.ready_timeout_s == 120
    e = cfg.engine
    assert (e.model, e.block_size, e.num_gpu_blocks, e.kv_cache_memory) == ("/models/llama", 32, 512, "1GiB")
    assert e.preemption_mode == "auto" and e.swap_space == pytest.approx(1e-3) and e.enable_prefix_caching is False
    r = cfg.router
    # model, host and port come from the top level: one source of truth
    assert (r.model, r.host, r.port) == ("/models/llama", "0.0.0.0", 50052)
    assert r.placement_policy == "least_loaded" and r.max_queue_requests == 64 and r.auth_token == "s3cret"
    assert cfg.worker.pressure_interval_ms == 25 and cfg.worker.stall_timeout_s == 60


def test_defaults_and_round_trip(tmp_path: Path) -> None:
    cfg = ClusterConfig.load(write(tmp_path, "model: /m\n"))
    assert cfg.address is None and cfg.workers == "auto" and cfg.port == 50051 and cfg.metrics_port == 9400
    assert cfg.host == "127.0.0.1" and cfg.engine.block_size == 16 and cfg.router.placement_policy == "kv_aware"
    assert ClusterConfig.from_dict(cfg.to_dict()) == cfg
    full = ClusterConfig.load(write(tmp_path, FULL_YAML))
    assert ClusterConfig.from_dict(full.to_dict()) == full


def test_kv_levers_from_yaml(tmp_path: Path) -> None:
    text = "model: /m\nengine: {kv_cache_dtype: int8, allocator: contiguous, reserve: max_tokens}\n"
    e = ClusterConfig.load(write(tmp_path, text)).engine
    assert (e.kv_cache_dtype, e.allocator, e.reserve) == ("int8", "contiguous", "max_tokens")


def test_empty_file_needs_model(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"model: required"):
        ClusterConfig.load(write(tmp_path, ""))
    assert ClusterConfig.load(write(tmp_path, ""), {"model": "/m"}).model == "/m"


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ("modle: /m", r"modle: unknown key"),
        ("engine: {blok_size: 16}", r"engine\.blok_size: unknown key"),
        ("router: {placement: kv_aware}", r"router\.placement: unknown key"),
        ("worker: {interval: 1}", r"worker\.interval: unknown key"),
        ("engine: {block_size: 12}", r"engine\.block_size: must be a positive power of two, got 12"),
        ("engine: {block_size: '16'}", r"engine\.block_size: expected an integer, got '16'"),
        ("engine: {block_size: true}", r"engine\.block_size: expected an integer, got True"),
        ("engine: {num_gpu_blocks: 0}", r"engine\.num_gpu_blocks: must be positive"),
        ("engine: {kv_cache_memory: lots}", r"engine\.kv_cache_memory: cannot parse size 'lots'"),
        ("engine: {gpu_memory_utilization: 1.5}", r"engine\.gpu_memory_utilization: must be in \(0, 1\]"),
        ("engine: {preemption_mode: sometimes}", r"engine\.preemption_mode: must be one of"),
        ("engine: {preemption_mode: swap}", r"engine\.preemption_mode: .*needs swap_space > 0"),
        ("engine: {watermark: 1.5}", r"engine\.watermark: must be in \[0, 1\)"),
        ("engine: {device: tpu}", r"engine\.device: must be auto, cpu or cuda"),
        ("engine: {kv_cache_dtype: int4}", r"engine\.kv_cache_dtype: must be one of \('auto', 'fp16', 'bf16', 'fp8'"),
        ("engine: {allocator: buddy}", r"engine\.allocator: must be"),
        ("engine: {model: /other}", r"engine\.model: not allowed in this section .*'model'"),
        ("engine: [1, 2]", r"engine: expected a mapping of EngineConfig fields"),
        ("router: {port: 1}", r"router\.port: not allowed in this section .*'port'"),
        ("router: {host: 0.0.0.0}", r"router\.host: not allowed in this section"),
        ("router: {placement_policy: random}", r"router\.placement_policy: must be one of \['kv_aware'"),
        ("router: {low_watermark: 0.95}", r"router\.low_watermark: need 0 <= low_watermark <= high_watermark"),
        ("router: {tls_cert: /c.pem}", r"router\.tls_cert: tls_cert and tls_key go together"),
        ("router: {max_queue_requests: -1}", r"router\.max_queue_requests: must be >= 0"),
        ("router: {stale_report_s: 0}", r"router\.stale_report_s: must be positive"),
        ("worker: {router_address: 'h:1'}", r"worker\.router_address: not allowed .*the launcher sets it"),
        ("worker: {credential: c}", r"worker\.credential: not allowed .*the launcher sets it"),
        ("worker: {stall_timeout_s: 0}", r"worker\.stall_timeout_s: must be positive"),
        ("worker: {pressure_interval_ms: -5}", r"worker\.pressure_interval_ms: must be >= 0"),
        ("workers: 0", r"workers: must be a positive integer or 'auto'"),
        ("workers: many", r"workers: must be a positive integer or 'auto'"),
        ("port: 70000", r"port: must be an integer in \[0, 65535\]"),
        ("metrics_port: http", r"metrics_port: expected an integer or null"),
        ("http_port: web", r"http_port: expected an integer or null"),
        ("http_port: 70000", r"http_port: must be an integer in \[0, 65535\]"),
        ("address: somewhere", r"address: must be null .*'auto' or HOST:PORT"),
        ("cpus_per_worker: 0", r"cpus_per_worker: must be a positive integer"),
        ("spread: 1", r"spread: expected true or false"),
        ("ready_timeout_s: -1", r"ready_timeout_s: must be a positive number"),
    ],
)
def test_bad_values_name_the_key(tmp_path: Path, yaml_text: str, message: str) -> None:
    path = write(tmp_path, "model: /m\n" + yaml_text + "\n")
    with pytest.raises(ValueError, match=message) as info:
        ClusterConfig.load(path)
    assert str(info.value).startswith(f"{path}: "), "the error names the file too"


def test_not_a_mapping_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="expected a mapping"):
        read_yaml(write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ValueError, match="not valid YAML"):
        read_yaml(write(tmp_path, "model: [unclosed\n"))
    with pytest.raises(ValueError, match="cannot read"):
        read_yaml(tmp_path / "missing.yaml")


def test_merge_recurses_into_sections() -> None:
    base = {"model": "/a", "engine": {"block_size": 16, "num_gpu_blocks": 8}}
    out = merge(base, {"engine": {"block_size": 32}, "port": 1})
    assert out == {"model": "/a", "port": 1, "engine": {"block_size": 32, "num_gpu_blocks": 8}}
    assert base["engine"]["block_size"] == 16, "merge does not mutate its input"


def test_flags_override_yaml(tmp_path: Path) -> None:
    path = write(tmp_path, FULL_YAML)
    args = parse_serve(
        "--config", str(path), "--workers", "2", "--port", "0", "--metrics-port", "off", "--address", "local",
        "--host", "127.0.0.1", "--block-size", "16", "--no-prefix-caching", "--preemption-mode", "recompute",
        "--placement-policy", "round_robin", "--auth-token", "flag-token", "--seed", "7",
    )  # fmt: skip
    cfg = config_from_args(args)
    assert cfg.workers == 2 and cfg.port == 0 and cfg.metrics_port is None and cfg.address is None
    assert cfg.host == "127.0.0.1" and cfg.router.host == "127.0.0.1" and cfg.router.port == 0
    assert cfg.engine.block_size == 16 and cfg.engine.enable_prefix_caching is False
    assert cfg.engine.preemption_mode == "recompute" and cfg.engine.seed == 7
    assert cfg.router.placement_policy == "round_robin" and cfg.router.auth_token == "flag-token"
    # values no flag touched stay as the file says (flags default to UNSET, not to a value)
    assert cfg.engine.num_gpu_blocks == 512 and cfg.engine.kv_cache_memory == "1GiB"
    assert cfg.cpus_per_worker == 2 and cfg.spread is True and cfg.router.max_queue_requests == 64
    assert cfg.worker.pressure_interval_ms == 25


def test_unset_flags_leave_no_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSERVE_AUTH_TOKEN", raising=False)
    args = parse_serve("--model", "/m")
    assert overrides_from_args(args) == {"model": "/m"}
    assert all(getattr(args, d) is UNSET for d in args.knob_flags if d != "model")


def test_auth_token_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_AUTH_TOKEN", "env-token")
    assert config_from_args(parse_serve("--model", "/m")).router.auth_token == "env-token"
    assert config_from_args(parse_serve("--model", "/m", "--auth-token", "x")).router.auth_token == "x"


def test_flag_errors_name_the_key() -> None:
    with pytest.raises(ValueError, match=r"engine\.block_size: must be a positive power of two"):
        config_from_args(parse_serve("--model", "/m", "--block-size", "24"))
    with pytest.raises(ValueError, match=r"model: required"):
        config_from_args(parse_serve("--port", "1"))
    with pytest.raises(SystemExit):
        parse_serve("--model", "/m", "--workers", "zero")


def test_workers_auto_and_gpus() -> None:
    cfg = ClusterConfig(model="/m")
    assert cfg.num_workers(num_gpus=0) == 2 and not cfg.use_gpus(0)
    assert cfg.num_workers(num_gpus=4) == 4 and cfg.use_gpus(4)
    cpu = ClusterConfig.from_dict({"model": "/m", "engine": {"device": "cpu"}})
    assert cpu.num_workers(num_gpus=4) == 2 and not cpu.use_gpus(4)
    cuda = ClusterConfig.from_dict({"model": "/m", "workers": 3, "engine": {"device": "cuda"}})
    assert cuda.num_workers(num_gpus=0) == 3 and cuda.use_gpus(0), "explicit cuda waits for GPU nodes to join"


def test_worker_tls_defaults_to_the_router_certificate() -> None:
    cfg = ClusterConfig.from_dict(
        {"model": "/m", "router": {"tls_cert": "/c.pem", "tls_key": "/k.pem", "tls_client_ca": "/ca.pem"}}
    )
    w = cfg.worker_options()
    assert (w.tls_ca, w.tls_cert, w.tls_key) == ("/c.pem", "/c.pem", "/k.pem")
    own = ClusterConfig.from_dict(
        {"model": "/m", "router": {"tls_cert": "/c.pem", "tls_key": "/k.pem"}, "worker": {"tls_ca": "/ca.pem"}}
    )
    assert own.worker_options().tls_ca == "/ca.pem" and own.worker_options().tls_cert is None
    # Frontends on a TLS cluster are accepted (they serve TLS and dial the router with these credentials).
    fronted = ClusterConfig.from_dict(
        {"model": "/m", "frontends": 2, "router": {"tls_cert": "/c.pem", "tls_key": "/k.pem"}}
    )
    assert fronted.frontends == 2 and fronted.worker_options().tls_ca == "/c.pem"


def test_config_is_frozen() -> None:
    import dataclasses

    cfg = ClusterConfig(model="/m")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.port = 1  # type: ignore[misc]
