"""deploy/: manifests parse, their `kvserve serve` command lines are accepted by the real CLI, what
they reference exists, and every metric the alerts and the dashboard use is one kvserve exports."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvserve.cluster.cli import build_parser
from kvserve.cluster.config import ClusterConfig
from kvserve.cluster.serve_cli import config_from_args

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
YAML_FILES = sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))
SHELL_BREAKS = {";", "&&", "&", "||", "|", ">", ">>", "<", "2>&1", "(", ")"}


def load_all(path: Path) -> list[Any]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def strings(node: Any) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for v in node.values():
            yield from strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from strings(v)


def serve_commands(text: str) -> list[list[str]]:
    """Argument lists after ``kvserve serve`` in a shell command string (up to ; && > & ...)."""
    if not re.search(r"\bkvserve\s+serve\b", text):
        return []
    lex = shlex.shlex(text, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    tokens = list(lex)
    out = []
    for i in range(len(tokens) - 1):
        if tokens[i] == "kvserve" and tokens[i + 1] == "serve":
            args = []
            for tok in tokens[i + 2 :]:
                if tok in SHELL_BREAKS:
                    break
                args.append(tok)
            out.append(args)
    return out


def manifest_serve_commands() -> list[tuple[str, list[str]]]:
    found = []
    for path in YAML_FILES:
        for doc in load_all(path):
            for s in strings(doc):
                for args in serve_commands(s):
                    found.append((str(path.relative_to(ROOT)), args))
    return found


def kuberay_docs() -> dict[str, dict]:
    """The first document of each kind (the router's Service before the frontends')."""
    docs: dict[str, dict] = {}
    for d in load_all(DEPLOY / "kuberay" / "raycluster.yaml"):
        docs.setdefault(d["kind"], d)
    return docs


def kuberay_doc(kind: str, name: str) -> dict:
    (doc,) = [d for d in load_all(DEPLOY / "kuberay" / "raycluster.yaml") if (d["kind"], d["metadata"]["name"]) ==
              (kind, name)]  # fmt: skip
    return doc


# ---- parsing --------------------------------------------------------------------------------
@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_yaml_parses(path: Path) -> None:
    assert load_all(path), f"{path} is empty"


def test_expected_files_exist() -> None:
    for rel in ("kuberay/raycluster.yaml", "ray/cluster.yaml", "docker/Dockerfile", "prometheus/prometheus.yml",
                "prometheus/alerts.yml", "grafana/kvserve.json", "README.md"):  # fmt: skip
        assert (DEPLOY / rel).is_file(), rel
    json.loads((DEPLOY / "grafana" / "kvserve.json").read_text())


# ---- kvserve serve command lines --------------------------------------------------------------
def test_manifests_run_kvserve_serve() -> None:
    where = {path for path, _ in manifest_serve_commands()}
    assert "deploy/kuberay/raycluster.yaml" in where and "deploy/ray/cluster.yaml" in where


@pytest.mark.parametrize("where,argv", manifest_serve_commands(), ids=lambda x: x if isinstance(x, str) else "")
def test_serve_command_lines_are_accepted(where: str, argv: list[str], tmp_path: Path, monkeypatch) -> None:
    # --config names a file mounted in the pod: use the ConfigMap's content instead
    if "--config" in argv:
        i = argv.index("--config")
        cm = kuberay_docs()["ConfigMap"]["data"]["cluster.yaml"]
        (tmp_path / "cluster.yaml").write_text(cm)
        argv = [*argv[:i], "--config", str(tmp_path / "cluster.yaml"), *argv[i + 2 :]]
    monkeypatch.delenv("KVSERVE_AUTH_TOKEN", raising=False)
    args = build_parser().parse_args(["serve", *argv])  # SystemExit (argparse error) fails the test
    assert args.func.__module__ == "kvserve.cluster.serve_cli"
    cfg = config_from_args(args)  # ValueError (bad value / unknown key) fails the test
    # served beyond loopback, joining the cluster the manifest started, on the ports it exposes
    assert cfg.address == "auto" and cfg.host == "0.0.0.0"
    assert (cfg.port, cfg.metrics_port) == (50051, 9400)
    assert cfg.use_gpus(num_gpus=0), "GPU workers even before the GPU nodes have joined"


def test_kuberay_config_map_is_a_valid_cluster_config() -> None:
    cfg = ClusterConfig.from_dict(yaml.safe_load(kuberay_docs()["ConfigMap"]["data"]["cluster.yaml"]))
    assert cfg.engine.device == "cuda"
    gpu_groups = kuberay_docs()["RayCluster"]["spec"]["workerGroupSpecs"]
    gpus = sum(
        g["replicas"] * int(c["resources"]["limits"].get("nvidia.com/gpu", 0))
        for g in gpu_groups
        for c in g["template"]["spec"]["containers"]
    )
    assert cfg.workers == gpus, "one worker actor per GPU of the worker groups"


def test_kuberay_exposes_the_router_ports() -> None:
    docs = kuberay_docs()
    head = docs["RayCluster"]["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert {p["containerPort"] for p in head["ports"]} >= {50051, 9400}
    assert head["readinessProbe"]["grpc"]["port"] == 50051
    svc = docs["Service"]["spec"]
    assert {(p["name"], p["port"]) for p in svc["ports"]} == {("grpc", 50051), ("metrics", 9400)}
    assert svc["selector"] == {"ray.io/cluster": docs["RayCluster"]["metadata"]["name"], "ray.io/node-type": "head"}
    assert docs["RayCluster"]["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    for group in docs["RayCluster"]["spec"]["workerGroupSpecs"]:
        for c in group["template"]["spec"]["containers"]:
            limits, requests = c["resources"]["limits"], c["resources"]["requests"]
            assert limits["nvidia.com/gpu"] == requests["nvidia.com/gpu"], "GPU request = limit"
    mounts = {m["mountPath"] for m in head["volumeMounts"]}
    assert "/etc/kvserve" in mounts, "the ConfigMap reaches --config"


def test_kuberay_frontends_are_replicas_behind_one_service_dialing_the_router() -> None:
    from kvserve.cluster.cli import build_parser as cli_parser
    from kvserve.cluster.frontend_cli import settings_from_args

    deployment = kuberay_doc("Deployment", "kvserve-frontend")
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    (line,) = container["args"]
    argv = shlex.split(line.replace("exec ", "", 1).replace("$(POD_NAME)", "frontend-x"))
    assert argv[:2] == ["kvserve", "frontend"]
    args = cli_parser().parse_args(argv[1:])  # SystemExit (a flag the CLI lacks) fails the test
    settings = settings_from_args(args)
    assert settings.router_address == "kvserve:50051", "the router's Service and gRPC port"
    assert (settings.grpc_port, settings.http_port, settings.router.host) == (50052, 8000, "0.0.0.0")
    assert settings.router.model == yaml.safe_load(kuberay_docs()["ConfigMap"]["data"]["cluster.yaml"])["model"]
    assert {p["containerPort"] for p in container["ports"]} == {50052, 8000}
    assert container["readinessProbe"]["grpc"]["port"] == 50052
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    svc = kuberay_doc("Service", "kvserve-frontend")["spec"]
    assert svc["selector"].items() <= pod["metadata"]["labels"].items()
    assert {(p["name"], p["port"]) for p in svc["ports"]} == {("grpc", 50052), ("http", 8000)}
    router = kuberay_doc("Service", "kvserve")
    assert router["metadata"]["name"] == settings.router_address.split(":")[0]
    head = kuberay_docs()["RayCluster"]["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    key_env = {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for e in head["env"] if "valueFrom" in e}
    frontend_env = {e["name"]: e["valueFrom"].get("secretKeyRef", {}).get("name") for e in container["env"]}
    assert key_env["KVSERVE_FRONTEND_KEY"] == frontend_env["KVSERVE_FRONTEND_KEY"], "one frontend key for both"


def test_ray_cluster_launcher_yaml_matches_rays_schema() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    import ray.autoscaler

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(yaml.safe_load((DEPLOY / "ray" / "cluster.yaml").read_text()), schema)


# ---- Dockerfile -----------------------------------------------------------------------------------
def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (DEPLOY / "docker" / "Dockerfile").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_entrypoint_is_the_real_cli() -> None:
    ins = dockerfile_instructions()
    assert ins[0][0] == "FROM" and "nvidia/cuda" in ins[0][1], "a CUDA base image"
    entry = [json.loads(rest) for word, rest in ins if word == "ENTRYPOINT"]
    assert entry == [["kvserve"]]
    (script,) = importlib.metadata.entry_points(group="console_scripts", name="kvserve")
    assert callable(script.load()), f"{script.value} is the installed `kvserve`"
    assert f'kvserve = "{script.value}"' in (ROOT / "pyproject.toml").read_text()
    cmd = [json.loads(rest) for word, rest in ins if word == "CMD"][-1]
    assert build_parser().parse_args(cmd[:1] + ["--model", "/m"]).command == cmd[0]


def test_dockerfile_copies_every_package() -> None:
    copied = {rest.split()[0] for word, rest in dockerfile_instructions() if word == "COPY"}
    for src in copied:
        assert (ROOT / src).exists(), f"COPY {src}: no such path"
    include = re.search(r"^include = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M)
    packages = re.findall(r'"([^"]+)"', include.group(1))
    assert packages
    for pattern in packages:
        assert pattern.rstrip("*") in copied, f"package {pattern} is not copied into the image"


# ---- metrics used by alerts and the dashboard --------------------------------------------------------
def exported_sample_names() -> set[str]:
    """Every sample name kvserve/router/observe/metrics.py exports (counters with _total, histograms' series)."""
    from prometheus_client.metrics import MetricWrapperBase

    from kvserve.router.observe import metrics
    from kvserve.router.observe.loop_metrics import LoopCounter, LoopHistogram

    names = set()
    for obj in vars(metrics).values():
        if isinstance(obj, MetricWrapperBase | LoopCounter | LoopHistogram):
            for family in obj.describe():
                suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(family.type, [""])
                names |= {family.name + s for s in suffixes}
    return names


def alert_rules() -> list[dict]:
    doc = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def dashboard_exprs() -> list[str]:
    dash = json.loads((DEPLOY / "grafana" / "kvserve.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dash["templating"]["list"] if v.get("type") == "query"]
    return exprs


METRIC = re.compile(r"kvserve:[a-zA-Z0-9_:]+")


def test_every_metric_used_exists() -> None:
    exported = exported_sample_names()
    assert "kvserve:kv_cache_usage_perc" in exported and "kvserve:num_preemptions_total" in exported
    used = {m for e in [r["expr"] for r in alert_rules()] + dashboard_exprs() for m in METRIC.findall(e)}
    assert used, "the alerts and the dashboard use kvserve metrics"
    assert sorted(used - exported) == []


def test_alerts_cover_the_issue() -> None:
    rules = {r["alert"]: r for r in alert_rules()}
    usage = rules["KVServeKVCacheNearlyFull"]
    assert "kvserve:kv_cache_usage_perc" in usage["expr"] and "0.9" in usage["expr"] and usage["for"] == "5m"
    assert "kvserve:admission_rejections_total" in rules["KVServeAdmissionRejections"]["expr"]
    assert "kvserve:num_preemptions_total" in rules["KVServePreemptionStorm"]["expr"]
    assert "kvserve:worker_up" in rules["KVServeWorkerDown"]["expr"]
    assert "kvserve:pressure_report_age_seconds" in rules["KVServePressureReportsStale"]["expr"]
    for name, r in rules.items():
        assert r["labels"]["severity"] in ("warning", "critical"), name
        assert r["annotations"]["summary"], name


def test_dashboard_covers_the_issue() -> None:
    exprs = "\n".join(dashboard_exprs())
    for metric in ("kv_cache_usage_perc", "kv_blocks_cached_evictable", "kv_swap_blocks_used", "router_queue_requests",
                   "num_preemptions_total", "num_migrations_total", "prefix_cache_hits_total"):  # fmt: skip
        assert f"kvserve:{metric}" in exprs, metric
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds"):
        assert re.search(rf"histogram_quantile\(0\.\d+, sum by \(le\) \(rate\(kvserve:{hist}_bucket", exprs), hist
    assert 'worker=~"$worker"' in exprs, "per-worker panels follow the worker variable"


def test_prometheus_config_scrapes_the_metrics_port_and_loads_the_alerts() -> None:
    cfg = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert cfg["rule_files"] == ["alerts.yml"]
    job = next(j for j in cfg["scrape_configs"] if j["job_name"] == "kvserve")
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    assert targets and all(t.endswith(":9400") for t in targets)
    svc = kuberay_docs()["Service"]["metadata"]["name"]
    assert any(t.startswith(f"{svc}.") for t in targets), "the target is the Service deploy/kuberay defines"


def test_readme_names_every_file() -> None:
    readme = (DEPLOY / "README.md").read_text()
    for path in DEPLOY.rglob("*"):
        if path.is_file() and path.name != "README.md":
            assert str(path.relative_to(DEPLOY)) in readme, path


def test_no_stray_environment_dependence() -> None:
    # the manifests must not depend on this machine: no absolute paths into the repository
    for path in [*YAML_FILES, DEPLOY / "docker" / "Dockerfile"]:
        assert str(ROOT) not in path.read_text(), path
    assert os.sep == "/"
