"""The ``kvserve`` command line: ``model`` and ``generate`` here; ``serve``, ``demo``, ``status``, ``top``,
``bench`` and ``plan`` in the modules of ``COMMAND_MODULES``, each registering its own subcommands."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path


def _add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """A flag per EngineConfig field (``--block-size``...), generated from the dataclass (workers/knobs.py)."""
    from workers.config import EngineConfig
    from workers.knobs import add_arguments

    add_arguments(p.add_argument_group("engine"), EngineConfig)


def engine_config_from_args(args: argparse.Namespace):
    """The EngineConfig of ``--model`` and the engine flags (ValueError on a bad value)."""
    from workers.config import EngineConfig
    from workers.knobs import knobs

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
    from workers.sampling_params import SamplingParams

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
    from workers.chat_template import ChatMessage, ChatTemplate
    from workers.tokenizer import load_tokenizer

    template, tokenizer = ChatTemplate.from_dir(model_dir), load_tokenizer(model_dir)
    if template is None or tokenizer is None:
        raise ValueError(f"--chat: {model_dir} has no chat template (tokenizer_config.json chat_template)")
    return [
        tokenizer.encode(template.render([ChatMessage(*m) for m in p]), add_special_tokens=False)
        if _is_chat(p)
        else p
        for p in prompts
    ]


def cmd_generate(args: argparse.Namespace) -> int:
    prompts = read_prompts(args)
    params = sampling_params_from_args(args)
    if args.server:
        from cluster.client import generate_remote

        results = generate_remote(args, prompts, params)
    else:
        from workers.engine import LLM

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvserve", description="A Ray-based LLM serving cluster with a paged KV cache"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="model utilities")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    from workers.random_model import add_init_random_arguments, run_init_random

    init = model_sub.add_parser("init-random", help="write a random-weight HF-format checkpoint + tokenizer.json")
    add_init_random_arguments(init)
    init.set_defaults(func=run_init_random)
    from cluster.model_fetch import add_fetch_arguments, run_fetch

    fetch = model_sub.add_parser("fetch", help="download a real model (models.json) and write it as an HF directory")
    add_fetch_arguments(fetch)
    fetch.set_defaults(func=run_fetch)

    gen = sub.add_parser("generate", help="generate offline (or against a server with --server)")
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

    for register in _optional_commands():
        register(sub)
    return parser


# Subcommands living in their own modules, each exposing ``register(subparsers)``.
COMMAND_MODULES = (
    "cluster.serve_cli",  # serve, demo
    "cluster.remote_cli",  # status
    "cluster.top",  # top
    "cluster.bench.cli",  # bench offline|kernels
    "cluster.plan",  # plan
)


def _optional_commands():
    import importlib

    out = []
    for mod in COMMAND_MODULES:
        try:
            out.append(importlib.import_module(mod).register)
        except ModuleNotFoundError as e:
            if e.name != mod:  # a real missing dependency inside the module: say so
                raise
    return out


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
