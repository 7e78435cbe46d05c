"""Knobs: a config field's default, help, choices and check, declared once on its dataclass.

Every component config (``EngineConfig``, ``WorkerOptions``, ``RouterConfig``, ``ClusterConfig``)
declares its fields with :func:`knob`. From those declarations:

- :func:`validate` checks each value (``__post_init__`` calls it; cross-field rules stay there);
- :func:`add_arguments` generates the command-line flags (``--block-size`` for ``block_size``);
- :func:`values_from_args` reads the flags back into constructor keywords;
- ``kvserve/cluster/config.py`` generates the YAML keys (a section's keys are its dataclass's fields).

So a new knob is one ``knob(...)`` line (plus any cross-field rule) in its component's config
module; the CLI, the YAML loader and the validation pick it up from there.

NOTE: a leaf module (stdlib only): the configs that use it are imported by the control side
(router, CLI), which must not pull in torch, grpc or Ray.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Check:
    """A rule on one value: ``test(value)`` must hold, else ``"<field> <words>, got <value>"``."""

    test: Callable[[Any], bool]
    words: str


POSITIVE = Check(lambda v: v > 0, "must be positive")
NON_NEGATIVE = Check(lambda v: v >= 0, "must be >= 0")
POWER_OF_TWO = Check(lambda v: v > 0 and not v & (v - 1), "must be a positive power of two")
PORT = Check(lambda v: 0 <= v < 65536, "must be in [0, 65535]")
FRACTION = Check(lambda v: 0.0 <= v <= 1.0, "must be in [0, 1]")


def knob(
    default: Any = dataclasses.MISSING,
    *,
    help: str,  # noqa: A002 - argparse's word
    choices: Sequence[Any] | None = None,
    check: Check | None = None,
    flag: str | None = None,
    parse: Callable[[str], Any] | None = None,
    cli: bool = True,
    env: str | None = None,
) -> Any:
    """A dataclass field carrying its help, choices and check.

    Args:
        default: the default value (omit for a required field).
        help: one line for ``--help`` and the docs.
        choices: the allowed values (checked by :func:`validate`, offered by the flag).
        check: a rule on the value (skipped for None, which the annotation admits or not).
        flag: the command-line flag when it is not ``--field-name`` (e.g. ``--no-prefix-caching``
            for a True-by-default bool; such a flag stores False).
        parse: converts the flag's text (default: from the annotation: int, float or str).
        cli: False for fields that a command sets itself (e.g. ``model``, given by ``--model``).
        env: an environment variable whose value is the flag's default.
    """
    metadata = {
        "help": help,
        "choices": choices,
        "check": check,
        "flag": flag,
        "parse": parse,
        "cli": cli,
        "env": env,
    }
    return dataclasses.field(default=default, metadata=metadata)


def knobs(cls: type) -> list[dataclasses.Field]:
    """The fields of ``cls`` declared with :func:`knob`, in declaration order."""
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def validate(obj: Any) -> None:
    """Check every knob of ``obj`` against its choices and check.

    Raises:
        ValueError: ``"<field> must be ..., got <value>"`` for the first bad field.
    """
    for f in knobs(type(obj)):
        value = getattr(obj, f.name)
        if value is None:
            continue
        choices = f.metadata["choices"]
        if choices is not None and value not in choices:
            raise ValueError(f"{f.name} must be one of {choices}, got {value!r}")
        check: Check | None = f.metadata["check"]
        if check is not None:
            ok = False
            try:
                ok = bool(check.test(value))
            except TypeError:
                pass
            if not ok:
                raise ValueError(f"{f.name} {check.words}, got {value!r}")


def flag_name(f: dataclasses.Field, prefix: str = "") -> str:
    """``--block-size`` for ``block_size`` (``--<prefix>-block-size`` with a prefix), or the declared flag."""
    declared = f.metadata.get("flag")
    if declared:
        return declared
    return "--" + (f"{prefix}-" if prefix else "") + f.name.replace("_", "-")


def same_as(cls: type, name: str) -> Any:
    """A field declared like ``cls``'s ``name`` (same default, help, choices and check).

    For a config that carries another's knob (``SchedulerConfig`` carries ``EngineConfig.block_size``):
    the knob stays declared once.
    """
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return dataclasses.field(default=f.default, metadata=f.metadata)


def _annotation_types(f: dataclasses.Field) -> set[str]:
    return {t.strip() for t in str(f.type).split("|")}


def _parser_for(f: dataclasses.Field) -> Callable[[str], Any] | None:
    if f.metadata.get("parse"):
        return f.metadata["parse"]
    types = _annotation_types(f)
    if "str" in types:
        return None
    if "int" in types:
        return int
    if "float" in types:
        return float
    return None


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def add_arguments(
    group: argparse._ActionsContainer,
    cls: type,
    *,
    prefix: str = "",
    dest_prefix: str = "",
    unset: Any = dataclasses.MISSING,
    environ: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Add a flag for every command-line knob of ``cls`` to ``group``.

    Args:
        group: a parser or argument group.
        cls: a dataclass declared with :func:`knob`.
        prefix: flag prefix, e.g. ``worker`` -> ``--worker-stall-timeout-s`` (keeps flag names unique).
        dest_prefix: prefix of the namespace attribute (keeps two configs' same-named fields apart).
        unset: every flag's default when given (e.g. a sentinel meaning "keep the YAML value");
            otherwise the field's default.
        environ: where ``knob(env=...)`` defaults are read (e.g. ``os.environ``); None = not read.

    Returns:
        ``{dest: field name}`` for every flag added.

    Raises:
        ValueError: a True-by-default bool knob without a declared negative ``flag``.
    """
    added: dict[str, str] = {}
    for f in knobs(cls):
        if not f.metadata["cli"]:
            continue
        dest = dest_prefix + f.name
        default = _default_of(f) if unset is dataclasses.MISSING else unset
        env = f.metadata.get("env")
        if env and environ is not None and environ.get(env):
            default = environ[env]
        help_text = f.metadata["help"]
        shown = _default_of(f)
        if not f.metadata.get("flag") and shown not in (None, "") and "default" not in help_text:
            help_text += f" (default: {shown})"
        if env:
            help_text += f" (default: ${env})"
        kwargs: dict[str, Any] = {"dest": dest, "default": default, "help": help_text}
        if _annotation_types(f) != {"bool"} and f.metadata["choices"] is None:
            kwargs["metavar"] = f.name.upper()
        if _annotation_types(f) == {"bool"}:
            if _default_of(f) and not f.metadata.get("flag"):
                raise ValueError(f"{cls.__name__}.{f.name}: a True-by-default switch needs a negative flag= (--no-...)")
            kwargs["action"] = "store_false" if _default_of(f) else "store_true"
        else:
            parser = _parser_for(f)
            if parser is not None:
                kwargs["type"] = parser
            if f.metadata["choices"] is not None:
                kwargs["choices"] = f.metadata["choices"]
        group.add_argument(flag_name(f, prefix), **kwargs)
        added[dest] = f.name
    return added


def values_from_args(
    args: argparse.Namespace, dests: Mapping[str, str], unset: Any = dataclasses.MISSING
) -> dict[str, Any]:
    """``{field name: value}`` for the flags in ``dests`` (from :func:`add_arguments`), skipping ``unset``."""
    out: dict[str, Any] = {}
    for dest, name in dests.items():
        value = getattr(args, dest)
        if unset is not dataclasses.MISSING and value is unset:
            continue
        out[name] = value
    return out
