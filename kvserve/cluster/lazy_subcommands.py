"""Subcommands declared by name and help, built only when chosen, so a light command stays light.

``kvserve plan`` is arithmetic; building every subcommand's parser up front would import torch, grpc
and ray (the modules that define ``serve``, ``top``, ``bench kernels``...) just to print its help.
``LazySubParsers`` keeps a placeholder parser per command (enough for the top-level ``--help`` and
usage) and runs the command's loader, which imports its module and registers the real parser, only
when argparse reaches that command on the command line.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping

Loader = Callable[["LazySubParsers"], None]


class LazySubParsers(argparse._SubParsersAction):
    """A subparsers action (``add_subparsers(action=LazySubParsers)``) with lazily built commands.

    ``add_lazy({name: help}, loader)`` declares commands; when one of them is chosen, every
    placeholder of that loader is dropped and ``loader(self)`` is called: it must ``add_parser`` each
    declared name (with its real arguments and ``set_defaults(func=...)``).
    """

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 - argparse's signature
        super().__init__(*args, **kwargs)
        self._loaders: dict[str, Loader] = {}

    def add_lazy(self, commands: Mapping[str, str], loader: Loader) -> None:
        """Declare ``commands`` (name -> one-line help), built by ``loader`` when one is chosen."""
        for name, help_text in commands.items():
            self.add_parser(name, help=help_text, add_help=False)
            self._loaders[name] = loader

    def load(self, name: str) -> argparse.ArgumentParser:
        """The real parser of command ``name``, building it (and its loader's siblings) if still lazy.

        Raises:
            KeyError: ``name`` is not a command.
            RuntimeError: the loader did not register ``name``.
        """
        loader = self._loaders.get(name)
        if loader is not None:
            siblings = {n for n, other in self._loaders.items() if other is loader}
            for sibling in siblings:
                del self._loaders[sibling]
                del self._name_parser_map[sibling]
            self._choices_actions[:] = [a for a in self._choices_actions if a.dest not in siblings]
            loader(self)
            missing = siblings - self._name_parser_map.keys()
            if missing:
                raise RuntimeError(f"the loader of {name!r} did not register {sorted(missing)}")
        return self._name_parser_map[name]

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # noqa: ANN001
        if values and values[0] in self._loaders:
            self.load(values[0])
        super().__call__(parser, namespace, values, option_string)


def module_loader(module: str, function: str = "register") -> Loader:
    """A loader that imports ``module`` and calls its ``function(subparsers)``."""

    def load(subparsers: LazySubParsers) -> None:
        import importlib

        getattr(importlib.import_module(module), function)(subparsers)

    load.__qualname__ = f"module_loader({module!r})"
    return load
