"""The line protocol between ``kvserve bench offline --peer`` and a peer engine's script.

A peer script runs in the peer's own virtual environment (``kvserve/cluster/bench/setup_peers.sh``), so it may
import only the standard library, its engine and this module (stdlib only; the script's folder is on
``sys.path`` when Python runs it as a file). The exchange, one JSON document per line on stdout, each
line starting with ``PREFIX`` (everything else the peer prints, e.g. its engine's logs, is ignored):

1. runner: ``PEER_PYTHON SCRIPT --model DIR --prompts FILE`` where FILE is
   ``{"prompt_token_ids": [[...], ...], "max_tokens": N}`` (greedy, ignore_eos, fp32), plus, when the
   bench sets any, ``"engine": {"max_num_seqs": S}`` (at most S requests running at once, as our
   engine runs them: the served batch sizes); a peer that cannot apply a setting exits with an error
   naming it, so that no figure is silently taken at a different batch;
2. peer: loads the model, warms up, prints ``PREFIX READY {"engine": NAME, "version": V}``;
3. runner: writes ``run`` on the peer's stdin; peer: runs every prompt once and prints
   ``PREFIX RESULT {"seconds": S, "token_ids": [[...], ...]}`` (input order, wall time of the pass);
   repeated once per round;
4. runner: closes stdin; peer: exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

PREFIX = "KVSERVE_PEER"
READY = "READY"
RESULT = "RESULT"
RUN_COMMAND = "run"


def emit(kind: str, payload: dict) -> None:
    """Print one protocol line and flush (the runner waits for it)."""
    print(f"{PREFIX} {kind} {json.dumps(payload)}", flush=True)


@dataclass(frozen=True)
class PeerSpec:
    """What a peer runs: the model, the prompts, the output length and engine settings (step 1)."""

    model: str
    prompt_ids: list[list[int]]
    max_tokens: int
    engine: dict = field(default_factory=dict)  # e.g. {"max_num_seqs": 8}


def load_spec(argv: list[str] | None = None) -> PeerSpec:
    """The ``PeerSpec`` of a peer script's command line."""
    p = argparse.ArgumentParser(description="a kvserve bench peer (see kvserve/cluster/bench/peers_protocol.py)")
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True)
    args = p.parse_args(argv)
    with open(args.prompts) as f:
        spec = json.load(f)
    return PeerSpec(args.model, spec["prompt_token_ids"], int(spec["max_tokens"]), dict(spec.get("engine") or {}))


def parse_args(argv: list[str] | None = None) -> tuple[str, list[list[int]], int]:
    """``(model dir, prompt token-id lists, max tokens)``: ``load_spec`` for a peer without engine settings."""
    spec = load_spec(argv)
    return spec.model, spec.prompt_ids, spec.max_tokens


def serve(engine: str, version: str, generate: Callable[[], list[list[int]]]) -> None:
    """Announce READY, then time ``generate()`` once per ``run`` line on stdin until stdin closes."""
    emit(READY, {"engine": engine, "version": version})
    for line in sys.stdin:
        if line.strip() != RUN_COMMAND:
            raise SystemExit(f"peer: unknown command {line.strip()!r}")
        t0 = time.perf_counter()
        token_ids = generate()
        emit(RESULT, {"seconds": time.perf_counter() - t0, "token_ids": token_ids})
