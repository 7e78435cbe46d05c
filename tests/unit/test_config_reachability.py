"""Every config knob is reachable from both the command line and cluster.yaml, declared in one place."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from kvserve.cluster.cli import build_parser, command_parser, engine_config_from_args
from kvserve.cluster.config import _RESERVED, _SECTIONS, ClusterConfig
from kvserve.cluster.serve_cli import config_from_args
from kvserve.workers.core.knobs import Check, knob, knobs, validate
from kvserve.workers.engine.config import EngineConfig

# Fields a command or the launcher fills in rather than the user (the YAML loader refuses them too).
SET_ELSEWHERE = {section: set(keys) for section, keys in _RESERVED.items()}


def _serve_flags() -> dict[str, tuple[str | None, str]]:
    return build_parser().parse_args(["serve"]).knob_flags


# Valid non-default values for free-text fields whose check would refuse a path.
SAMPLES = {"device": "cpu", "dtype": "float16", "kv_cache_memory": "1GiB", "address": "auto", "workers": 3,
           "high_watermark": 0.95, "low_watermark": 0.5, "host_cache_memory": "1GiB",
           "disk_cache_size": "2GiB", "placement_scorers": "prefix_affinity=3,migration_load=1"}  # fmt: skip


def _sample_value(f: dataclasses.Field) -> object:
    """A valid non-default value for ``f`` (so reaching it is visible)."""
    if f.name in SAMPLES:
        return SAMPLES[f.name]
    if f.metadata.get("choices"):
        return next(c for c in f.metadata["choices"] if c != f.default)
    if "bool" in str(f.type):
        return not f.default
    if "int" in str(f.type) and "float" not in str(f.type):
        return 8 if f.name != "port" else 1234
    if "float" in str(f.type):
        return 0.5
    return "/some/value"


def test_every_field_is_a_knob() -> None:
    """No field of a component config escapes the one declaration (help, default, checks)."""
    for cls in (ClusterConfig, *_SECTIONS.values()):
        undeclared = {f.name for f in dataclasses.fields(cls)} - {f.name for f in knobs(cls)} - set(_SECTIONS)
        assert not undeclared, f"{cls.__name__} fields without knob(): {undeclared}"
        assert all(f.metadata["help"] for f in knobs(cls)), f"{cls.__name__}: a knob without help"


@pytest.mark.parametrize("section", [None, *_SECTIONS])
def test_every_field_reachable_from_serve_flags_and_yaml(section: str | None) -> None:
    cls = _SECTIONS[section] if section else ClusterConfig
    reserved = SET_ELSEWHERE.get(section or "", set())
    wanted = {f.name for f in knobs(cls)} - reserved
    by_flag = {key for sec, key in _serve_flags().values() if sec == section}
    assert wanted <= by_flag, f"{section or 'top level'}: no serve flag for {sorted(wanted - by_flag)}"
    for name in sorted(wanted):
        if section is None:
            continue  # top-level keys are checked by test_config.py's full YAML
        f = next(f for f in knobs(cls) if f.name == name)
        value = _sample_value(f)
        data = {"model": "/m", section: {name: value}}
        if section == "router" and name in ("tls_cert", "tls_key", "tls_client_ca"):
            data[section] = {"tls_cert": "/c", "tls_key": "/k", name: value}
        if section == "router" and name == "metrics_auth":
            data[section] = {"auth_token": "t", name: value}  # it needs the client API's auth
        if section == "engine" and name == "preemption_mode" and value == "swap":
            data[section]["swap_space"] = 1.0
        cfg = ClusterConfig.from_dict(data)
        assert getattr(getattr(cfg, section), name) == value, f"{section}.{name} from YAML"


@pytest.mark.parametrize("section", list(_SECTIONS))
def test_serve_flag_reaches_its_field(section: str) -> None:
    """Each generated flag lands on its field: a non-default value through argv ends up in the config."""
    cls = _SECTIONS[section]
    for dest, (sec, name) in _serve_flags().items():
        if sec != section:
            continue
        f = next(f for f in knobs(cls) if f.name == name)
        value = _sample_value(f)
        flag = next(a for a in command_parser(build_parser(), "serve")._actions
                    if a.dest == dest).option_strings[0]  # fmt: skip
        argv = ["serve", "--model", "/m"]
        if section == "router" and name in ("tls_cert", "tls_key", "tls_client_ca"):
            argv += ["--tls-cert", "/c", "--tls-key", "/k"]  # a pair; the flag under test overrides its half
        if section == "router" and name == "metrics_auth":
            argv += ["--auth-token", "t"]
        argv += [flag] if isinstance(value, bool) else [flag, str(value)]
        if section == "engine" and name == "preemption_mode" and value == "swap":
            argv += ["--swap-space", "1"]
        cfg = config_from_args(build_parser().parse_args(argv))
        assert getattr(getattr(cfg, section), name) == value, f"{flag} -> {section}.{name}"


def test_every_engine_field_reachable_from_generate() -> None:
    wanted = {f.name for f in knobs(EngineConfig)} - {"model"}
    for name in sorted(wanted):
        f = next(f for f in knobs(EngineConfig) if f.name == name)
        value = _sample_value(f)
        flag = f.metadata["flag"] or "--" + name.replace("_", "-")
        argv = ["generate", "--model", "/m", flag] + ([] if isinstance(value, bool) else [str(value)])
        if name == "preemption_mode" and value == "swap":
            argv += ["--swap-space", "1"]
        cfg = engine_config_from_args(build_parser().parse_args(argv))
        assert getattr(cfg, name) == value, f"generate {flag} -> engine.{name}"


def test_a_new_knob_is_one_declaration() -> None:
    """A knob declared on a dataclass gets its flag, its validation and its help from that line alone."""

    @dataclasses.dataclass(frozen=True)
    class Toy:
        chunk_tokens: int = knob(32, help="tokens per chunk", check=Check(lambda v: v > 0, "must be positive"))
        mode: str = knob("fast", help="how", choices=("fast", "safe"))

        def __post_init__(self) -> None:
            validate(self)

    from kvserve.workers.core.knobs import add_arguments, values_from_args

    parser = argparse.ArgumentParser()
    dests = add_arguments(parser, Toy)
    assert Toy(**values_from_args(parser.parse_args(["--chunk-tokens", "64", "--mode", "safe"]), dests)) == Toy(
        64, "safe"
    )
    assert "tokens per chunk" in parser.format_help()
    with pytest.raises(ValueError, match=r"chunk_tokens must be positive, got 0"):
        Toy(chunk_tokens=0)
    with pytest.raises(ValueError, match=r"mode must be one of \('fast', 'safe'\), got 'slow'"):
        Toy(mode="slow")
    with pytest.raises(SystemExit):
        parser.parse_args(["--mode", "slow"])
