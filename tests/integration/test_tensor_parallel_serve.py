"""Tensor-parallel workers behind the router, on real Ray: each worker is a 2-rank gloo group whose ranks are Ray
actors in the worker's own STRICT_PACK placement group (rank 0 = the worker actor in bundle 0, rank 1 = a
``RankActor`` in bundle 1); the router sees one worker per group. Streams equal offline greedy (TP=1) and HF; a
rank actor SIGKILLed mid-stream takes its worker down as one, the stream continues token-identical (replayed on
the other worker) and the group comes back whole (Ray restarts rank 0, which starts a new rank actor in the same
bundle), as it does when the rank actor hangs (SIGSTOP) or rank 0 itself is SIGKILLed; shutdown leaves no
placement group and no actor behind."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvserve.cluster.client import KVServeClient
from kvserve.router.config import RouterConfig
from kvserve.workers.core.sampling_params import SamplingParams
from kvserve.workers.engine.config import EngineConfig
from kvserve.workers.parallel.launchers import ACTOR_NAME_PREFIX
from tests.integration.test_router import rand_prompt

RPC_TIMEOUT = 180.0


@pytest.fixture(scope="module")
def tp_cluster(ray_session, tiny_llama_dir: Path) -> Iterator:
    from kvserve.cluster.launch import start_cluster

    engine = EngineConfig(str(tiny_llama_dir), num_gpu_blocks=128, tensor_parallel_size=2)
    cluster = start_cluster(engine, 2, RouterConfig(port=0, model=str(tiny_llama_dir)), ready_timeout_s=240)
    yield cluster
    cluster.shutdown()


@pytest.fixture(scope="module")
def expected(tiny_llama_dir: Path):
    import torch

    from kvserve.workers.engine.engine import LLM

    llm = LLM(str(tiny_llama_dir), num_gpu_blocks=256)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)

    def run(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        return [o.token_ids for o in outs]

    yield run
    torch.set_num_threads(threads)


def _actor_table() -> dict[str, dict[str, Any]]:
    """Ray's actor table (GCS), by actor id: every actor of this cluster's life, dead ones included."""
    import ray

    return dict(ray._private.state.actors())


def _rank_actors(cluster, worker_id: str) -> list[Any]:
    """The live rank actors (ranks 1..N-1) in ``worker_id``'s placement group, by their names."""
    import ray

    prefix = f"{ACTOR_NAME_PREFIX}:{cluster.tp_groups[worker_id].id.hex()}:"
    return [ray.get_actor(name) for name in ray.util.list_named_actors() if name.startswith(prefix)]


def _where(actor) -> dict[str, Any]:
    import ray

    return ray.get(actor.where.remote(), timeout=60)


def _bundles_in_use(pg) -> list[bool]:
    """Per bundle of ``pg``: whether its CPUs are taken (Ray accounts bundle i's as ``CPU_group_<i>_<id>``)."""
    import ray

    total, free = ray.cluster_resources(), ray.available_resources()
    n = len(ray.util.placement_group_table(pg)["bundles"])
    keys = [f"CPU_group_{i}_{pg.id.hex()}" for i in range(n)]
    assert all(total.get(k, 0) > 0 for k in keys), sorted(k for k in total if pg.id.hex() in k)
    return [free.get(k, 0) < total[k] for k in keys]


def _pid(cluster, worker_id: str) -> int:
    import ray

    return int(ray.get(cluster.workers[worker_id].pid.remote(), timeout=60))


def _assert_group_placed(cluster, worker_id: str) -> dict[str, Any]:
    """``worker_id``'s group: a STRICT_PACK placement group of 2 bundles on one node, both taken, its one rank
    actor in it on that node; returns the rank actor's ``where``."""
    import ray

    pg = cluster.tp_groups[worker_id]
    table = ray.util.placement_group_table(pg)
    assert table["strategy"] == "STRICT_PACK" and table["state"] == "CREATED"
    assert table["bundles"] == {0: {"CPU": 1.0}, 1: {"CPU": 1.0}}  # one bundle per rank, cpus_per_worker each
    (node,) = set(table["bundles_to_node_id"].values())  # a group is placed on one node
    assert _bundles_in_use(pg) == [True, True]  # rank 0 (the worker actor) in bundle 0, rank 1 in bundle 1
    (rank1,) = _rank_actors(cluster, worker_id)
    where = _where(rank1)
    assert where["placement_group_id"] == pg.id.hex() and where["node_id"] == node
    assert where["pid"] not in {p.pid for p in _children(_pid(cluster, worker_id))}  # not a child process
    return where


def _children(pid: int) -> list:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def test_tp_ranks_are_ray_actors_in_strict_pack_groups(tp_cluster, expected, hf_greedy, tiny_llama_dir) -> None:
    groups = {w: g.id.hex() for w, g in tp_cluster.tp_groups.items()}
    assert sorted(groups) == ["worker-0", "worker-1"] and len(set(groups.values())) == 2  # a group per worker
    for worker_id in tp_cluster.workers:
        _assert_group_placed(tp_cluster, worker_id)
    prompts = [rand_prompt(i, n) for i, n in enumerate((5, 17, 33, 48))]
    with KVServeClient(tp_cluster.address, timeout=RPC_TIMEOUT) as client:
        with cf.ThreadPoolExecutor(len(prompts)) as ex:
            futures = [ex.submit(client.generate_all, p, max_tokens=16, ignore_eos=True) for p in prompts]
            results = [f.result(timeout=RPC_TIMEOUT) for f in futures]
        status = client.status()
    want = expected(prompts, 16)
    assert [ids for ids, _, _ in results] == want == hf_greedy(tiny_llama_dir, prompts, 16)
    assert sorted(w.worker_id for w in status.workers) == ["worker-0", "worker-1"]  # one worker per group
    assert [w.tensor_parallel_size for w in status.workers] == [2, 2]  # what `kvserve top` shows as tp


def test_killed_rank_actor_replays_elsewhere_and_group_returns(tp_cluster, expected) -> None:
    prompt = rand_prompt(77, 20)
    tokens, victim, old_pid, old = _signal_rank_mid_stream(tp_cluster, prompt, signal.SIGKILL)
    assert tokens == expected([prompt], 96)[0]  # the stream went on elsewhere, token-identical
    _assert_group_returns(tp_cluster, victim, old_pid, old["actor_id"], expected)


def _signal_rank_mid_stream(tp_cluster, prompt: list[int], sig: signal.Signals, stopped: list[int] | None = None):  # noqa: ANN001, ANN202
    """Stream 96 tokens of ``prompt``; after 4, send ``sig`` to the rank actor of the worker serving it (its pid
    appended to ``stopped``). Returns (tokens, the worker, rank 0's pid, the rank actor's placement before)."""
    tokens: list[int] = []
    victim = old_pid = old = None
    with KVServeClient(tp_cluster.address, timeout=RPC_TIMEOUT) as client:
        with client.generate(prompt, max_tokens=96, ignore_eos=True) as stream:
            for response in stream:
                tokens.extend(response.token_ids)
                if victim is None and len(tokens) >= 4 and response.worker_id:
                    victim = response.worker_id
                    old_pid = _pid(tp_cluster, victim)
                    (rank1,) = _rank_actors(tp_cluster, victim)
                    old = _where(rank1)
                    if stopped is not None:
                        stopped.append(old["pid"])
                    os.kill(old["pid"], sig)  # the rank actor's process, mid-stream
    assert victim is not None and old is not None
    return tokens, victim, old_pid, old


def test_hung_rank_actor_takes_its_group_down_and_group_returns(tp_cluster, expected) -> None:
    """SIGSTOP a rank actor mid-stream (alive to the OS and to Ray, never answers its collective): rank 0's step
    blocks without computing, the liveness rule declares the worker stalled, its stream is replayed elsewhere
    token-identical and the group comes back whole without the hung rank (killed, not resumed)."""
    prompt = rand_prompt(78, 20)
    stopped: list[int] = []
    try:
        tokens, victim, old_pid, old = _signal_rank_mid_stream(tp_cluster, prompt, signal.SIGSTOP, stopped)
        assert tokens == expected([prompt], 96)[0]  # the stream went on elsewhere, token-identical
        _assert_group_returns(tp_cluster, victim, old_pid, old["actor_id"], expected)
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)  # only if the test failed before the group replaced it
            except ProcessLookupError:
                pass


def test_killed_rank0_ends_its_rank_actor_and_group_returns(tp_cluster, expected) -> None:
    """SIGKILL rank 0 (the worker actor's process): its rank actor does not outlive it, and Ray's restart of
    rank 0 brings the group back whole in the same bundles."""
    victim = "worker-1"
    old_pid = _pid(tp_cluster, victim)
    (rank1,) = _rank_actors(tp_cluster, victim)
    old = _where(rank1)
    os.kill(old_pid, signal.SIGKILL)
    _assert_group_returns(tp_cluster, victim, old_pid, old["actor_id"], expected)


def _assert_group_returns(cluster, victim: str, old_pid: int, old_rank: str, expected) -> None:
    """The group comes back whole: a new rank 0 (Ray restarted the worker actor) with a new rank actor in bundle
    1, the old rank actor dead (never restarted alone, never left beside the new one), serving token-identical."""
    deadline = time.monotonic() + 180
    new = None
    while time.monotonic() < deadline:
        try:
            pid = _pid(cluster, victim)
            ranks = _rank_actors(cluster, victim)
            new = _where(ranks[0]) if len(ranks) == 1 else None
        except Exception:  # noqa: BLE001 - restarting: an actor does not answer yet
            pid, new = None, None
        if pid is not None and pid != old_pid and new is not None and new["actor_id"] != old_rank:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"{victim} did not come back as a whole group")
    assert _assert_group_placed(cluster, victim)["actor_id"] == new["actor_id"]  # same group, same bundles
    assert _actor_table()[old_rank]["State"] == "DEAD"
    # and both groups serve again, token-identical
    with KVServeClient(cluster.address, timeout=RPC_TIMEOUT) as client:
        wait = time.monotonic() + 120
        while not all(w.healthy for w in client.status().workers):
            assert time.monotonic() < wait, "the restarted worker never became healthy"
            time.sleep(0.2)
        prompts = [rand_prompt(80 + i, 12) for i in range(4)]
        with cf.ThreadPoolExecutor(len(prompts)) as ex:
            results = list(ex.map(lambda p: client.generate_all(p, max_tokens=8, ignore_eos=True), prompts))
    assert [ids for ids, _, _ in results] == expected(prompts, 8)


def test_shutdown_leaves_no_placement_group_nor_actor(tp_cluster) -> None:
    """Runs last in this module: it shuts the module's cluster down (the fixture's shutdown is then a no-op)."""
    import ray

    groups = dict(tp_cluster.tp_groups)
    ranks = {_where(a)["actor_id"] for w in tp_cluster.workers for a in _rank_actors(tp_cluster, w)}
    assert len(ranks) == 2
    workers = {w._actor_id.hex() for w in tp_cluster.workers.values()}
    tp_cluster.shutdown()
    for pg in groups.values():
        assert ray.util.placement_group_table(pg)["state"] == "REMOVED"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        table = _actor_table()
        left = [a for a in ranks | workers if table[a]["State"] != "DEAD"]
        if not left:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"actors left alive after shutdown: {left}")
    assert not [n for n in ray.util.list_named_actors() if n.startswith(ACTOR_NAME_PREFIX)]
