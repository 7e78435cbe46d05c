"""The ``kvserve`` command line: ``model`` and ``generate`` here; ``serve``, ``demo``, ``status``, ``top``,
``drain``, ``rollout``, ``bench`` and ``plan`` in their own modules, each registering its subcommands
(``register(subparsers)``).
Every command is declared in ``COMMANDS`` and built only when chosen (``cluster.lazy_subcommands``)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from kvserve.cluster.lazy_subcommands import LazySubParsers, module_loader


def _add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """A flag per EngineConfig field (``--block-size``...), generated from the dataclass (workers/core/knobs.py)."""
    from kvserve.workers.core.knobs import add_arguments
    from kvserve.workers.engine.config import EngineConfig

    add_arguments(p.add_argument_group("engine"), EngineConfig)


def engine_config_from_args(args: argparse.Namespace):
    """The EngineConfig of ``--model`` and the engine flags (ValueError on a bad value)."""
    from kvserve.workers.core.knobs import knobs
    from kvserve.workers.engine.config import EngineConfig

    values = {f.name: getattr(args, f.name) for f in knobs(EngineConfig) if f.metadata["cli"]}
    return EngineConfig(model=args.model, **values)


def _add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed (reproducible sampling)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--stop-token-id", type=int, action="append", default=[], help="stop token id (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def sampling_params_from_args(args: argparse.Namespace):
    from kvserve.workers.core.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.sampling_seed,
        stop=tuple(args.stop),
        stop_token_ids=tuple(args.stop_token_id),
        ignore_eos=args.ignore_eos,
    )


def read_prompts(args: argparse.Namespace) -> list:
    """Prompts from ``--prompt`` (text, repeatable) and/or ``--prompt-token-ids FILE`` (JSON list of lists)."""
    prompts: list = list(args.prompt or [])
    if args.prompt_token_ids:
        path = Path(args.prompt_token_ids)
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise SystemExit(f"error: --prompt-token-ids {path}: {e}") from e
        if not isinstance(data, list) or not all(
            isinstance(p, list) and all(isinstance(t, int) for t in p) for p in data
        ):
            raise SystemExit(f"error: --prompt-token-ids {path}: expected a JSON list of token-id lists")
        prompts.extend(data)
    # A chat prompt: [(role, content), ...], rendered with the model's chat template.
    prompts.extend([("user", q)] for q in getattr(args, "chat", None) or [])
    if not prompts:
        raise SystemExit("error: give --prompt TEXT, --chat QUESTION and/or --prompt-token-ids FILE")
    return prompts


def _is_chat(prompt: object) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], tuple)


def _render_chats(prompts: list, model_dir: str) -> list:
    """Offline: chat prompts -> token ids through the model's chat template (as the router does)."""
    if not any(_is_chat(p) for p in prompts):
        return prompts
    from kvserve.workers.text.chat_encoding import encode_chat
    from kvserve.workers.text.chat_template import ChatMessage, ChatTemplate
    from kvserve.workers.text.tokenizer import load_tokenizer

    template, tokenizer = ChatTemplate.from_dir(model_dir), load_tokenizer(model_dir)
    if template is None or tokenizer is None:
        raise ValueError(f"--chat: {model_dir} has no chat template (tokenizer_config.json chat_template)")
    return [
        encode_chat(tokenizer, template, [ChatMessage(*m) for m in p]) if _is_chat(p)
        else p
        for p in prompts
    ]


def cmd_generate(args: argparse.Namespace) -> int:
    prompts = read_prompts(args)
    params = sampling_params_from_args(args)
    if args.server:
        from kvserve.cluster.client import generate_remote

        results = generate_remote(args, prompts, params)
    else:
        from kvserve.workers.engine.engine import LLM

        try:
            llm = LLM.from_config(engine_config_from_args(args))
            prompts_in = _render_chats(prompts, args.model)
            outs = llm.generate(prompts_in, params, use_tqdm=not args.json and sys.stderr.isatty())
        except (ValueError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        results = [(o.token_ids, o.text, o.finish_reason) for o in outs]
    if args.json:
        print(json.dumps([ids for ids, _, _ in results]))
    else:
        for prompt, (ids, text, reason) in zip(prompts, results, strict=True):
            if _is_chat(prompt):
                shown = prompt[-1][1]
            else:
                shown = prompt if isinstance(prompt, str) else f"<{len(prompt)} token ids>"
            print(f"prompt: {shown!r}\noutput: {text!r}\ntoken_ids: {ids}\nfinish_reason: {reason}\n")
    return 0


def _register_model(sub: argparse._SubParsersAction) -> None:
    """``kvserve model init-random|fetch``."""
    model = sub.add_parser("model", help=COMMANDS["model"])
    # NOTE: intermixed parsing, so `fetch NAME --dtype X OUT` works as well as `fetch --dtype X NAME OUT`
    # (plain argparse binds every positional at the first one and rejects OUT after an option).
    model_sub = model.add_subparsers(dest="model_command", required=True, parser_class=IntermixedArgumentParser)
    from kvserve.workers.models.random_model import add_init_random_arguments, run_init_random

    init = model_sub.add_parser("init-random", help="write a random-weight HF-format checkpoint + tokenizer.json")
    add_init_random_arguments(init)
    init.set_defaults(func=run_init_random)
    from kvserve.cluster.model_fetch import add_fetch_arguments, run_fetch

    fetch = model_sub.add_parser("fetch", help="download a real model (models.json) and write it as an HF directory")
    add_fetch_arguments(fetch)
    fetch.set_defaults(func=run_fetch)


def _register_generate(sub: argparse._SubParsersAction) -> None:
    """``kvserve generate`` (offline, or against a server with ``--server``)."""
    gen = sub.add_parser("generate", help=COMMANDS["generate"])
    gen.add_argument("--model", help="HF model directory (offline mode)")
    gen.add_argument("--server", default=None, help="HOST:PORT of a kvserve router (remote mode)")
    gen.add_argument(
        "--auth-token",
        default=os.environ.get("KVSERVE_AUTH_TOKEN"),
        help="bearer token (remote mode; default: $KVSERVE_AUTH_TOKEN)",
    )
    gen.add_argument("--tls-ca", default=None, help="PEM CA of the router's certificate: use TLS (remote mode)")
    gen.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    gen.add_argument("--prompt-token-ids", help="JSON file: a list of token-id lists")
    gen.add_argument("--chat", action="append", help="a user message, sent through the chat template (repeatable)")
    gen.add_argument("--json", action="store_true", help="print only a JSON list of generated-id lists")
    _add_sampling_arguments(gen)
    _add_engine_arguments(gen)
    gen.set_defaults(func=cmd_generate)


class IntermixedArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose positionals may follow options (``parse_intermixed_args`` semantics),
    also when it is a subcommand's parser (argparse calls ``parse_known_args`` on those)."""

    _intermixing = False

    def parse_known_args(self, args=None, namespace=None):  # noqa: ANN001, ANN201 - argparse's signature
        if self._intermixing:  # the two passes of parse_known_intermixed_args
            return super().parse_known_args(args, namespace)
        self._intermixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False


# The top-level commands and their one-line help. Each is built only when chosen (LazySubParsers), by
# the loader named in _LOADERS: `kvserve plan` must not import torch, grpc or ray for its parser.
COMMANDS = {
    "model": "model utilities: init-random, fetch",
    "generate": "generate offline (or against a server with --server)",
    "serve": "run a serving cluster (router + workers) until SIGINT/SIGTERM",
    "demo": "local cluster + chat workload (SmolLM2, or a random model) + live view + summary",
    "status": "per-worker KV block pressure of a running cluster",
    "top": "live view of a cluster's KV block pressure",
    "drain": "drain one worker of a running cluster: move its requests away, restart it, take it back",
    "rollout": "drain and restart every worker of a running cluster, one at a time",
    "bench": "benchmarks: offline engine, served cluster, router, kernels",
    "plan": "KV memory per token/request/users, and how many users fit",
    "frontend": "a stateless frontend: the client gRPC and HTTP APIs, relayed to a router",
}
# Loader per group of commands registered together (a module's ``register(subparsers)``).
_LOADERS = (
    (("model",), _register_model),
    (("generate",), _register_generate),
    (("serve", "demo"), module_loader("kvserve.cluster.serve_cli")),
    (("status",), module_loader("kvserve.cluster.remote_cli")),
    (("top",), module_loader("kvserve.cluster.top")),
    (("drain", "rollout"), module_loader("kvserve.cluster.drain_cli")),
    (("bench",), module_loader("kvserve.cluster.bench.cli")),
    (("plan",), module_loader("kvserve.cluster.plan")),
    (("frontend",), module_loader("kvserve.cluster.frontend_cli")),
)


def build_parser() -> argparse.ArgumentParser:
    """The ``kvserve`` parser; a command's own parser is built (its module imported) when it is parsed,
    or by ``command_parser``."""
    parser = argparse.ArgumentParser(
        prog="kvserve", description="A Ray-based LLM serving cluster with a paged KV cache"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, action=LazySubParsers)
    for names, loader in _LOADERS:
        sub.add_lazy({name: COMMANDS[name] for name in names}, loader)
    return parser


def command_parser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The fully built parser of top-level command ``name`` (for tests and tools that walk its flags)."""
    sub = next(a for a in parser._actions if isinstance(a, LazySubParsers))
    return sub.load(name)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.command == "generate" and not args.server and not args.model:
        parser.error("generate needs --model DIR (offline) or --server HOST:PORT")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
