"""``kvserve serve`` with the chaos tests' router actor (tests/chaos/fault_router.py ``FaultRouter``):
``python -m tests.chaos.fault_serve FLAGS`` takes ``kvserve serve``'s flags and runs the same
``serve`` (kvserve/cluster/serve_cli.py), with ``start_cluster``'s ``router_actor`` seam set, so a
restarted router is a ``FaultRouter`` too. Run it from the repo root: Ray imports
``tests.chaos.fault_router`` in the router's process from the driver's working directory.
"""

from __future__ import annotations

import argparse
import logging
import sys

from kvserve.cluster.serve_cli import add_serve_arguments, config_from_args, serve
from tests.chaos.fault_router import FaultRouter


def main(argv: list[str] | None = None) -> int:
    """Parse ``kvserve serve``'s flags and serve until SIGINT/SIGTERM; the exit status (2: a bad flag)."""
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.fault_serve")
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    # NOTE: as ``kvserve``'s main does (kvserve/cluster/cli.py): the tests read serve's log lines.
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return serve(cfg, router_actor=FaultRouter)


if __name__ == "__main__":
    sys.exit(main())
