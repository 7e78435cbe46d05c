"""A helper process that joins a running ``kvserve serve``'s Ray cluster and answers questions
about it on stdin/stdout, one JSON line per command (so chaos tests need no Ray of their own).

Usage: ``python -m tests.chaos.ray_probe GCS_ADDRESS``; then write lines:
``{"op": "pid", "worker_id": "worker-0"}`` -> ``{"ok": true, "value": 12345}``
``{"op": "integrity"}`` -> ``{"ok": true, "value": {"worker-0": null, ...}}`` (error text or null;
``"worker_ids": [...]`` checks only those)
``{"op": "router_pid"}`` -> ``{"ok": true, "value": 12345}``
``{"op": "arm_migration_fault", "phase": "before_import", "action": "kill", "side": "src"}`` -> the next
migration SIGKILLs (or, "hang", SIGSTOPs) that side's worker at that phase boundary (a router that
is tests/chaos/fault_router.py's ``FaultRouter`` only)
``{"op": "migrate", "request_id": "r1", "dst": "worker-1"}`` -> whether the router's live migration moved it
``{"op": "frontend_pid", "index": 0}`` -> ``{"ok": true, "value": 12345}`` (``--frontends``: waits
for a restarting frontend to be back)
The router actor is looked up by name for every command (``serve`` may have restarted it).
Errors come back as ``{"ok": false, "error": "..."}``; EOF on stdin ends the process.
"""

from __future__ import annotations

import json
import logging
import sys

import ray

from kvserve.cluster.config import RAY_NAMESPACE, ROUTER_ACTOR_NAME
from kvserve.cluster.frontends import FRONTEND_NAME

TIMEOUT_S = 60.0


def _integrity(router: ray.actor.ActorHandle, worker_ids: list[str] | None = None) -> dict[str, str | None]:
    status_bytes = ray.get(router.cluster_status.remote(), timeout=TIMEOUT_S)
    from kvserve.protos.kvserve.v1 import serving_pb2 as spb

    status = spb.ClusterStatus.FromString(status_bytes)
    out: dict[str, str | None] = {}
    for w in status.workers:
        if worker_ids is not None and w.worker_id not in worker_ids:
            continue
        try:
            ray.get(router.check_worker_integrity.remote(w.worker_id), timeout=TIMEOUT_S)
            out[w.worker_id] = None
        except Exception as e:  # noqa: BLE001 - reported to the test, which fails on it
            out[w.worker_id] = repr(e)
    return out


def main(gcs_address: str) -> None:
    ray.init(address=gcs_address, namespace=RAY_NAMESPACE, logging_level=logging.ERROR, log_to_driver=False)
    ray.get_actor(ROUTER_ACTOR_NAME)
    print(json.dumps({"ok": True, "value": "ready"}), flush=True)
    for line in sys.stdin:
        try:
            cmd = json.loads(line)
            router = ray.get_actor(ROUTER_ACTOR_NAME)
            if cmd["op"] == "router_pid":
                value = ray.get(router.pid.remote(), timeout=TIMEOUT_S)
            elif cmd["op"] == "pid":
                value = ray.get(router.worker_pid.remote(cmd["worker_id"]), timeout=TIMEOUT_S)
            elif cmd["op"] == "arm_migration_fault":
                value = ray.get(router.arm_migration_fault.remote(cmd["phase"], cmd["action"], cmd["side"]),
                                timeout=TIMEOUT_S)  # fmt: skip
            elif cmd["op"] == "migrate":
                value = ray.get(router.migrate.remote(cmd["request_id"], cmd["dst"]), timeout=TIMEOUT_S)
            elif cmd["op"] == "owned_keys":
                value = ray.get(router.owned_keys.remote(), timeout=TIMEOUT_S)
            elif cmd["op"] == "frontend_pid":
                frontend = ray.get_actor(FRONTEND_NAME.format(cmd["index"]))
                value = ray.get(frontend.pid.remote(), timeout=TIMEOUT_S)
            elif cmd["op"] == "integrity":
                value = _integrity(router, cmd.get("worker_ids"))
            else:
                raise ValueError(f"unknown op {cmd['op']!r}")
            print(json.dumps({"ok": True, "value": value}), flush=True)
        except Exception as e:  # noqa: BLE001 - one bad command must not end the probe
            print(json.dumps({"ok": False, "error": repr(e)}), flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
