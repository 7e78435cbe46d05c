"""The ``kvserve`` parser: commands are built only when chosen (a light command imports nothing heavy),
and ``model`` subcommands accept positionals after options."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from kvserve.cluster.cli import COMMANDS, build_parser, command_parser
from kvserve.cluster.lazy_subcommands import LazySubParsers

HEAVY = ("torch", "grpc", "ray", "triton")


def _heavy_modules_after(argv: list[str]) -> list[str]:
    """Run ``kvserve ARGV`` in a fresh interpreter; the heavy modules it imported."""
    code = (
        "import json, sys\n"
        "from kvserve.cluster.cli import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)), file=sys.stderr)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "--help"],
        ["plan", "--preset", "llama-3-8b", "--context", "4096", "--users", "1,8", "--gpu-memory", "80GiB"],
        ["--help"],
        ["bench", "router", "--help"],
    ],
    ids=["plan-help", "plan", "help", "bench-router-help"],
)
def test_light_commands_import_no_heavy_module(argv: list[str]) -> None:
    assert _heavy_modules_after(argv) == []


def test_the_check_can_fail() -> None:
    """Building a heavy command's parser does import torch (model fetch dequantizes with it)."""
    assert "torch" in _heavy_modules_after(["model", "fetch", "--help"])


def test_top_level_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert name in out


def test_only_the_chosen_command_is_built() -> None:
    built: list[str] = []

    def loader(names: tuple[str, ...]):  # noqa: ANN202
        def load(sub: LazySubParsers) -> None:
            built.extend(names)
            for name in names:
                p = sub.add_parser(name)
                p.add_argument("--flag", default=name)

        return load

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True, action=LazySubParsers)
    sub.add_lazy({"a": "A", "b": "B"}, loader(("a", "b")))
    sub.add_lazy({"c": "C"}, loader(("c",)))
    args = parser.parse_args(["b", "--flag", "x"])
    assert (args.command, args.flag) == ("b", "x")
    assert built == ["a", "b"], "one loader builds its group, the other never runs"
    assert parser.parse_args(["a"]).flag == "a", "a built command parses again without rebuilding"
    assert built == ["a", "b"]


def test_a_loader_that_forgets_its_command_is_an_error() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True, action=LazySubParsers)
    sub.add_lazy({"a": "A"}, lambda s: None)
    with pytest.raises(RuntimeError, match="did not register"):
        parser.parse_args(["a"])


def test_command_parser_builds_the_real_parser() -> None:
    serve = command_parser(build_parser(), "serve")
    assert any("--workers" in a.option_strings for a in serve._actions)


@pytest.mark.parametrize(
    "argv",
    [
        ["model", "fetch", "smollm2-135m-instruct", "--dtype", "bfloat16", "/tmp/out"],
        ["model", "fetch", "--dtype", "bfloat16", "smollm2-135m-instruct", "/tmp/out"],
        ["model", "fetch", "smollm2-135m-instruct", "/tmp/out", "--dtype", "bfloat16"],
    ],
    ids=["out-after-option", "options-first", "options-last"],
)
def test_model_fetch_positionals_mix_with_options(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    assert (args.name, args.dtype, args.out_dir) == ("smollm2-135m-instruct", "bfloat16", "/tmp/out")


def test_model_fetch_out_is_optional_and_unknown_names_are_refused() -> None:
    args = build_parser().parse_args(["model", "fetch", "smollm2-135m-instruct", "--dtype", "float32"])
    assert (args.name, args.dtype, args.out_dir) == ("smollm2-135m-instruct", "float32", None)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["model", "fetch", "no-such-model"])


def test_model_init_random_positional_after_option() -> None:
    args = build_parser().parse_args(["model", "init-random", "--arch", "qwen2", "/tmp/m", "--size", "tiny"])
    assert (args.arch, args.size, args.out_dir) == ("qwen2", "tiny", "/tmp/m")
