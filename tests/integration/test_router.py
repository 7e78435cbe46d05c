"""The router end to end: real Ray actors, real gRPC on 127.0.0.1, the tiny random Llama on CPU.

One two-worker cluster serves most tests (module fixture); clusters whose router config must
differ (a tiny pool behind a 2-request queue, watermark migration, auth, TLS) are class fixtures,
so at most two clusters are up at once. Every test that ran requests on a cluster leaves it idle
and checks it: no used blocks, nothing running or queued, block-pool integrity on every worker.

The client retry logic (RESOURCE_EXHAUSTED + retry-after-ms) is tested against a scripted
in-process server, where the refusals are exact.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import math
import random
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvserve.cluster.client import AsyncKVServeClient, KVServeClient, retry_after_s
from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.protos.kvserve.v1 import serving_pb2_grpc
from kvserve.router.config import RouterConfig
from kvserve.router.gate.validation import MAX_STOP_STRINGS, MAX_TEXT_CHARS
from kvserve.workers.core.sampling_params import SamplingParams
from kvserve.workers.engine.config import EngineConfig
from kvserve.workers.transport.worker import WorkerOptions

VOCAB = 32000  # kvserve/workers/models/random_model.py
MAX_MODEL_LEN = 4096
BLOCK = 16
MAIN_BLOCKS = 128  # per worker: 2048 tokens
RPC_TIMEOUT = 60.0  # no test request may take this long: a hang fails instead of blocking the suite


# ---- helpers ---------------------------------------------------------------------------------------
def rand_prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def wait_until(pred, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def used_blocks(client: KVServeClient, worker_id: str) -> int:
    return next(w.report.used_blocks for w in client.status().workers if w.worker_id == worker_id)


def wait_idle(client: KVServeClient, cluster, timeout: float = 20.0) -> spb.ClusterStatus:
    """Until every worker reports no used blocks and nothing running/waiting, the router holds
    no request, and the workers' own counters agree; then every block pool passes its integrity
    check. NOTE: the workers are asked too because a report can predate an Abort still on the link
    (the router forgets a cancelled request at once; its worker frees the blocks a step later)."""
    import ray

    last: list = []
    handles = list(cluster.workers.values())

    def idle() -> bool:
        st = client.status()
        last[:] = [st]
        return (
            len(st.workers) == len(cluster.workers)
            and all(w.healthy for w in st.workers)
            and all(
                w.report.used_blocks == 0
                and w.report.num_running == 0
                and w.report.num_waiting == 0
                and w.report.num_swapped == 0
                and w.blocks_in_flight == 0
                and w.report.free_blocks + w.report.cached_evictable_blocks == w.report.total_blocks
                for w in st.workers
            )
            and st.router.requests_in_flight == 0
            and st.router.queue_requests == 0
            and workers_idle()
        )

    def workers_idle() -> bool:
        stats = ray.get([h.stats.remote() for h in handles], timeout=30)
        last[1:] = stats
        return all(s.used_blocks == 0 and s.num_running == 0 and s.num_waiting == 0 for s in stats)

    deadline = time.monotonic() + timeout
    while not idle():
        if time.monotonic() > deadline:
            pytest.fail(f"cluster not idle after {timeout}s: {last}")
        time.sleep(0.05)
    ray.get([h.check_integrity.remote() for h in handles], timeout=30)
    return last[0]


def start(tiny_llama_dir: Path, num_workers: int = 2, blocks: int = MAIN_BLOCKS, **router_kw):
    from kvserve.cluster.launch import start_cluster

    worker_options = router_kw.pop("worker_options", None)
    engine = EngineConfig(str(tiny_llama_dir), num_gpu_blocks=blocks)
    router = RouterConfig(port=0, model=str(tiny_llama_dir), **router_kw)
    return start_cluster(engine, num_workers, router, worker_options=worker_options, ready_timeout_s=120)


def greedy(llm, prompts: list, max_tokens: int):
    """Offline greedy reference, on one torch thread like the CPU workers.

    NOTE: two threads on a loaded 2-core machine run the tiny model ~10x slower (spinning
    OpenMP threads fight the workers for the cores).
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    finally:
        torch.set_num_threads(threads)


# ---- fixtures --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(ray_session, tiny_llama_dir):
    cl = start(tiny_llama_dir)
    yield cl
    cl.shutdown()


@pytest.fixture(scope="module")
def client(cluster) -> Iterator[KVServeClient]:
    with KVServeClient(cluster.address, timeout=RPC_TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    from kvserve.workers.engine.engine import LLM

    return LLM(str(tiny_llama_dir), num_gpu_blocks=512)


@pytest.fixture
def idle_after(client, cluster):
    """The test leaves the main cluster idle and consistent."""
    yield
    wait_idle(client, cluster)


# ---- serving ---------------------------------------------------------------------------------------
@pytest.mark.usefixtures("idle_after")
def test_concurrent_streams_equal_offline_greedy(client, llm):
    prompts = [rand_prompt(i, n) for i, n in enumerate((5, 16, 17, 33, 48, 70, 9, 100))]
    max_tokens = 24
    expected = greedy(llm, prompts, max_tokens)
    with cf.ThreadPoolExecutor(len(prompts)) as ex:
        futures = [ex.submit(client.generate_all, p, max_tokens=max_tokens, ignore_eos=True) for p in prompts]
        results = [f.result(timeout=RPC_TIMEOUT) for f in futures]
    for prompt, (ids, text, final), exp in zip(prompts, results, expected, strict=True):
        assert ids == exp.token_ids
        assert text == exp.text
        assert final.finish_reason == "length"
        assert final.usage.prompt_tokens == len(prompt)
        assert final.usage.completion_tokens == max_tokens
        assert final.worker_id in ("worker-0", "worker-1")
        assert final.request_id.startswith("req-")


@pytest.mark.usefixtures("idle_after")
def test_async_client_streams_equal_offline_greedy(cluster, llm):
    prompts = [rand_prompt(100 + i, 12 + 7 * i) for i in range(4)]
    expected = greedy(llm, prompts, 12)

    async def run():
        async with AsyncKVServeClient(cluster.address, timeout=RPC_TIMEOUT) as ac:
            results = await asyncio.gather(*(ac.generate_all(p, max_tokens=12, ignore_eos=True) for p in prompts))
            status = await ac.status()
            watch = ac.watch(interval_ms=50)
            seen = 0
            async for st in watch:
                assert len(st.workers) == 2
                seen += 1
                if seen == 2:
                    watch.cancel()
                    break
            return results, status

    results, status = asyncio.run(run())
    assert [ids for ids, _, _ in results] == [e.token_ids for e in expected]
    assert [final.finish_reason for _, _, final in results] == ["length"] * 4
    assert {w.worker_id for w in status.workers} == {"worker-0", "worker-1"}


@pytest.mark.usefixtures("idle_after")
def test_logprobs_stream_with_their_tokens(client, llm):
    from kvserve.workers.core.sampling_params import SamplingParams

    prompt = rand_prompt(150, 20)
    (expected,) = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2))
    with client.generate(prompt, max_tokens=6, ignore_eos=True, logprobs=2) as stream:
        responses = list(stream)
    ids = [t for r in responses for t in r.token_ids]
    logprobs = [lp for r in responses for lp in r.logprobs]
    assert ids == expected.token_ids and all(len(r.logprobs) == len(r.token_ids) for r in responses)
    for token, got, want in zip(ids, logprobs, expected.logprobs, strict=True):
        assert got.logprob == pytest.approx(want[token], abs=1e-4)
        assert dict(got.logprobs) == pytest.approx(want, abs=1e-4)
    _, _, plain = client.generate_all(prompt, max_tokens=2)
    assert not plain.logprobs  # not asked, not sent


@pytest.mark.usefixtures("idle_after")
def test_text_prompt_is_tokenized_by_the_router(client, llm):
    ids, text, final = client.generate_all("Hello paged world", max_tokens=6, ignore_eos=True)
    (expected,) = greedy(llm, ["Hello paged world"], 6)
    assert ids == expected.token_ids and text == expected.text
    assert final.usage.prompt_tokens == len(expected.prompt_token_ids)


@pytest.mark.usefixtures("idle_after")
def test_same_prefix_lands_on_the_worker_holding_it(client):
    # A long request makes one worker busy, so the prefix's first request goes to the other one;
    # after both finish, requests sharing that prefix must follow it there (an idle tie would
    # otherwise go to worker-0), and report the prefix blocks as cached.
    with client.generate(rand_prompt(200, 20), max_tokens=1500, ignore_eos=True) as busy:
        busy_worker = next(busy).worker_id
        wait_until(lambda: used_blocks(client, busy_worker) > 0, 10, "the busy worker's report")
        prefix = rand_prompt(201, 4 * BLOCK)
        _, _, first = client.generate_all(prefix + [5], max_tokens=2)
        holder = first.worker_id
        assert holder != busy_worker
        busy.cancel()
    wait_until(lambda: used_blocks(client, busy_worker) == 0, 10, "the busy worker to free its blocks")
    for i, suffix in enumerate(([6, 7], [8], list(range(10, 30)))):
        _, _, final = client.generate_all(prefix + suffix, max_tokens=2, request_id=f"prefix-follow-{i}")
        assert final.worker_id == holder, f"request {i} left the prefix holder"
        assert final.usage.cached_tokens >= 4 * BLOCK
    # The prefix-cache hit shows in the holder's status too, once its next pressure report
    # (rate-limited to one per 50 ms) has arrived.
    wait_until(
        lambda: (
            next(w.report for w in client.status().workers if w.worker_id == holder).prefix_cache_hit_tokens_total > 0
        ),
        10,
        "the holder's report to show prefix-cache hits",
    )


def test_tenants_never_share_cached_blocks(client, cluster):
    prefix = rand_prompt(300, 3 * BLOCK)
    _, _, a = client.generate_all(prefix + [1], max_tokens=1, tenant="tenant-a")
    _, _, b = client.generate_all(prefix + [2], max_tokens=1, tenant="tenant-b")
    _, _, a2 = client.generate_all(prefix + [3], max_tokens=1, tenant="tenant-a")
    assert b.usage.cached_tokens == 0
    assert a2.usage.cached_tokens >= 3 * BLOCK and a2.worker_id == a.worker_id
    wait_idle(client, cluster)


# ---- client gone: deadline, cancel, Abort ---------------------------------------------------------------
def test_deadline_frees_blocks_and_cluster_keeps_serving(client, cluster):
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        client.generate_all(rand_prompt(400, 40), max_tokens=1800, ignore_eos=True, timeout=0.7)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - t0 < 10
    wait_idle(client, cluster, timeout=10)
    ids, _, final = client.generate_all(rand_prompt(401, 10), max_tokens=4)
    assert len(ids) == 4 and final.finish_reason


def test_cancel_frees_blocks_and_cluster_keeps_serving(client, cluster):
    stream = client.generate(rand_prompt(500, 40), max_tokens=1800, ignore_eos=True)
    first = next(stream)
    wait_until(lambda: used_blocks(client, first.worker_id) > 0, 10, "blocks in use")
    stream.cancel()
    with pytest.raises(grpc.RpcError) as e:
        for _ in stream:
            pass
    assert e.value.code() == grpc.StatusCode.CANCELLED
    wait_idle(client, cluster, timeout=10)
    ids, _, _ = client.generate_all(rand_prompt(501, 10), max_tokens=4)
    assert len(ids) == 4


def test_async_cancel_frees_blocks(client, cluster):
    async def run() -> str:
        async with AsyncKVServeClient(cluster.address, timeout=RPC_TIMEOUT) as ac:
            stream = ac.generate(rand_prompt(550, 40), max_tokens=1800, ignore_eos=True)
            first = await stream.__anext__()
            stream.cancel()
            with pytest.raises(grpc.RpcError) as e:
                await stream.__anext__()
            assert e.value.code() == grpc.StatusCode.CANCELLED
            return first.worker_id

    assert asyncio.run(run()) in cluster.workers
    wait_idle(client, cluster, timeout=10)


def test_abort_rpc_ends_the_stream_cancelled(client, cluster):
    stream = client.generate(rand_prompt(600, 30), max_tokens=1800, ignore_eos=True, request_id="abort-me.1")
    first = next(stream)
    assert first.request_id == "abort-me.1"
    assert client.abort("abort-me.1") is True
    with pytest.raises(grpc.RpcError) as e:
        for _ in stream:
            pass
    assert e.value.code() == grpc.StatusCode.CANCELLED
    assert "Abort" in e.value.details()
    wait_idle(client, cluster, timeout=10)
    assert client.abort("abort-me.1") is False  # gone
    assert client.abort("never-existed") is False
    # The id is free again.
    ids, _, _ = client.generate_all(rand_prompt(601, 10), max_tokens=3, request_id="abort-me.1")
    assert len(ids) == 3


def test_duplicate_request_id_is_already_exists(client, cluster):
    with client.generate(rand_prompt(700, 20), max_tokens=1800, ignore_eos=True, request_id="dup-1") as s:
        next(s)
        with pytest.raises(grpc.RpcError) as e:
            client.generate_all([1, 2, 3], max_tokens=2, request_id="dup-1")
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "dup-1" in e.value.details()
    wait_idle(client, cluster, timeout=10)


# ---- hostile input ----------------------------------------------------------------------------------
def _req(**kw) -> spb.GenerateRequest:
    sampling = kw.pop("sampling", {})
    if "text" not in kw and "token_ids" not in kw and not kw.pop("no_prompt", False):
        kw["token_ids"] = spb.TokenIds(ids=[5, 6, 7])
    return spb.GenerateRequest(sampling=spb.SamplingParams(**sampling), **kw)


HOSTILE = {
    "token-id-too-big": (_req(token_ids=spb.TokenIds(ids=[1, VOCAB])), "prompt.token_ids"),
    "token-id-negative": (_req(token_ids=spb.TokenIds(ids=[-5])), "prompt.token_ids"),
    "empty-token-ids": (_req(token_ids=spb.TokenIds(ids=[])), "prompt.token_ids"),
    "empty-text": (_req(text=""), "prompt.text"),
    "no-prompt": (_req(no_prompt=True), "prompt"),
    "prompt-too-long": (_req(token_ids=spb.TokenIds(ids=[7] * (MAX_MODEL_LEN + 1))), "prompt.token_ids"),
    "text-too-long": (_req(text="a" * (MAX_TEXT_CHARS + 1)), "prompt.text"),
    "temperature-negative": (_req(sampling={"temperature": -0.5}), "sampling.temperature"),
    "temperature-nan": (_req(sampling={"temperature": math.nan}), "sampling.temperature"),
    "temperature-inf": (_req(sampling={"temperature": math.inf}), "sampling.temperature"),
    "top-p-zero": (_req(sampling={"top_p": 0.0}), "top_p"),
    "top-p-above-one": (_req(sampling={"top_p": 1.5}), "top_p"),
    "top-k-vocab": (_req(sampling={"top_k": VOCAB}), "sampling.top_k"),
    "too-many-stops": (_req(sampling={"stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}), "sampling.stop"),
    "empty-stop": (_req(sampling={"stop": [""]}), "sampling.stop"),
    "stop-token-id": (_req(sampling={"stop_token_ids": [VOCAB + 1]}), "sampling.stop_token_ids"),
    "request-id-chars": (_req(request_id="bad id/../x"), "request_id"),
    "request-id-newline": (_req(request_id="ok\n"), "request_id"),
    "request-id-long": (_req(request_id="r" * 500), "request_id"),
    "tenant-long": (_req(tenant="t" * 1000), "tenant"),
    "max-tokens-never-fits": (_req(sampling={"max_tokens": 2**31}), "max_tokens"),
    "logprobs-too-many": (_req(sampling={"logprobs": 21}), "logprobs"),
    "max-tokens-beyond-pool": (_req(sampling={"max_tokens": 2 * MAIN_BLOCKS * BLOCK}), "max_tokens"),
}


def test_hostile_fields_are_invalid_argument_naming_the_field(client, cluster):
    stub = serving_pb2_grpc.KVServeStub(client._channel)
    for name, (request, field) in HOSTILE.items():
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(request, timeout=RPC_TIMEOUT))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, e.value.details())
        assert field in e.value.details(), (name, e.value.details())
    # Nothing was admitted, nothing leaked, and normal traffic is unaffected.
    st = wait_idle(client, cluster, timeout=10)
    assert st.router.rejections_total["queue_full_requests"] == 0
    ids, _, final = client.generate_all([5, 6, 7], max_tokens=3)
    assert len(ids) == 3 and final.finish_reason == "length"


# ---- migration ------------------------------------------------------------------------------------
def test_forced_migration_is_token_identical(client, cluster, llm):
    import ray

    prompt, max_tokens = rand_prompt(800, 37), 320
    (expected,) = greedy(llm, [prompt], max_tokens)
    # logprobs too: they must stay aligned with the tokens across the migration's de-duplication.
    with client.generate(prompt, max_tokens=max_tokens, ignore_eos=True, request_id="migrate-me", logprobs=0) as stream:
        responses = [next(stream)]
        while sum(len(r.token_ids) for r in responses) < 8:
            responses.append(next(stream))
        src = responses[0].worker_id
        dst = "worker-1" if src == "worker-0" else "worker-0"
        assert ray.get(cluster.router.migrate.remote("migrate-me", dst), timeout=30) is True
        responses += list(stream)
    ids = [t for r in responses for t in r.token_ids]
    final = responses[-1]
    assert ids == expected.token_ids
    assert [list(lp.logprobs) for r in responses for lp in r.logprobs] == [[t] for t in ids]
    assert "".join(r.text_delta for r in responses) == expected.text
    assert final.finish_reason == "length" and final.usage.completion_tokens == max_tokens
    assert final.num_migrations >= 1
    assert final.worker_id == dst
    assert {r.worker_id for r in responses} == {src, dst}
    st = wait_idle(client, cluster)
    assert next(w for w in st.workers if w.worker_id == src).num_migrations_total >= 1
    # The KV went from worker to worker: the router never deserialized it, so it never imported torch
    # (a MigrationState through the router did: ~180 MB of RSS and a stalled loop).
    router_maps = Path(f"/proc/{ray.get(cluster.router.pid.remote())}/maps").read_text()
    assert "libtorch" not in router_maps, "the router process loaded torch"
    # Unknown request / same worker / unknown worker: refused, nothing moves.
    assert ray.get(cluster.router.migrate.remote("no-such-request", dst), timeout=30) is False


# NOTE: the dedicated clusters are class-scoped (module-level fixtures used by one class each), so
# each is stopped as soon as its class is done.
@pytest.fixture(scope="class")
def wm_cluster(ray_session, tiny_llama_dir):
    # round_robin makes the layout deterministic: requests 1 and 3 share worker-0.
    cl = start(tiny_llama_dir, high_watermark=0.05, low_watermark=0.05, placement_policy="round_robin")
    yield cl
    cl.shutdown()


class TestWatermarkMigration:
    """high == low == 5%: a worker past ~6 blocks sheds a running request to a peer below 5%,
    only when the move leaves the peer below where the source was (so nothing bounces back)."""

    def test_watermark_migration_is_token_identical(self, wm_cluster, llm):
        long_a, long_b, short = rand_prompt(900, 40), rand_prompt(901, 40), rand_prompt(902, 8)
        expected = greedy(llm, [long_a, long_b], 160)
        with KVServeClient(wm_cluster.address, timeout=RPC_TIMEOUT) as c, cf.ThreadPoolExecutor(3) as pool:
            first = pool.submit(c.generate_all, long_a, max_tokens=160, ignore_eos=True)
            wait_until(lambda: sum(w.report.num_running for w in c.status().workers) >= 1, 30, "first request running")
            # The short one lands on worker-1 and leaves it idle again: the migration's destination.
            c.generate_all(short, max_tokens=2, ignore_eos=True)
            second = pool.submit(c.generate_all, long_b, max_tokens=160, ignore_eos=True)
            results = [first.result(RPC_TIMEOUT), second.result(RPC_TIMEOUT)]
            for (ids, text, final), exp in zip(results, expected, strict=True):
                assert ids == exp.token_ids
                assert text == exp.text
                assert final.finish_reason == "length"
            assert sum(final.num_migrations for _, _, final in results) == 1, "exactly one move, no bounce"
            st = wait_idle(c, wm_cluster)
            assert sum(w.num_migrations_total for w in st.workers) == 1


# ---- priority preemption ------------------------------------------------------------------------------
@pytest.fixture(scope="class")
def one_worker_cluster(ray_session, tiny_llama_dir):
    cl = start(tiny_llama_dir, num_workers=1, blocks=64)  # 1024 tokens
    yield cl
    cl.shutdown()


class TestPriorityPreemption:
    """One 64-block worker filled by a low-priority request; a high-priority one that does not fit
    next to it makes the router preempt the low one (RECOMPUTE: no swap space) and hand the
    newcomer to that worker. Both complete token-identical to the offline greedy run."""

    def test_high_priority_request_preempts_and_both_complete(self, one_worker_cluster, llm):
        low, high = rand_prompt(950, 600), rand_prompt(951, 420)  # 38 and 27 (+1 decode) blocks
        low_max, high_max = 400, 16  # low: 1000 tokens = 63 blocks at its longest; the pool is 64
        expected_low, expected_high = greedy(llm, [low], low_max)[0], greedy(llm, [high], high_max)[0]
        with KVServeClient(one_worker_cluster.address, timeout=RPC_TIMEOUT) as c, cf.ThreadPoolExecutor(1) as pool:
            with c.generate(low, max_tokens=low_max, ignore_eos=True, priority=0) as stream:
                responses = [next(stream)]
                # The router must see the low request's blocks before the high one arrives: then
                # the high one cannot be placed (26 blocks available < 28 needed) and is queued.
                wait_until(lambda: used_blocks(c, "worker-0") >= 38, 30, "the low request's blocks reported")
                urgent = pool.submit(c.generate_all, high, max_tokens=high_max, ignore_eos=True, priority=5)
                responses += list(stream)
            high_ids, high_text, high_final = urgent.result(RPC_TIMEOUT)
            low_ids = [t for r in responses for t in r.token_ids]
            assert low_ids == expected_low.token_ids
            assert "".join(r.text_delta for r in responses) == expected_low.text
            assert high_ids == expected_high.token_ids and high_text == expected_high.text
            assert high_final.finish_reason == "length" and responses[-1].finish_reason == "length"
            # Alone in a pool that holds it whole, the low request is only preempted by the router.
            assert responses[-1].num_preemptions >= 1
            wait_idle(c, one_worker_cluster)


# ---- overload -----------------------------------------------------------------------------------------
@pytest.fixture(scope="class")
def flood_cluster(ray_session, tiny_llama_dir):
    cl = start(tiny_llama_dir, blocks=8, max_queue_requests=2)
    yield cl
    cl.shutdown()


class TestFlood:
    """Two 8-block workers behind a 2-request router queue, hit by 20 requests at once."""

    def test_flood_rejects_some_with_retry_after_and_completes_the_rest(self, flood_cluster):
        n, max_tokens = 20, 80
        prompts = [rand_prompt(1000 + i, 40) for i in range(n)]  # 3 blocks each; 8 blocks at their longest
        barrier = threading.Barrier(n)
        with KVServeClient(flood_cluster.address, timeout=RPC_TIMEOUT, max_attempts=1) as c:

            def one(p):
                barrier.wait(timeout=30)
                try:
                    return c.generate_all(p, max_tokens=max_tokens, ignore_eos=True)
                except grpc.RpcError as e:
                    return e

            with cf.ThreadPoolExecutor(n) as ex:
                results = list(ex.map(one, prompts, timeout=2 * RPC_TIMEOUT))
            errors = [r for r in results if isinstance(r, grpc.RpcError)]
            done = [r for r in results if not isinstance(r, grpc.RpcError)]
            assert errors, "no request was refused"
            assert done, "every request was refused"
            for e in errors:  # none hung (DEADLINE_EXCEEDED) or failed otherwise
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (e.code(), e.details())
                wait = retry_after_s(e)
                assert wait is not None and 0 < wait <= 30, e.trailing_metadata()
            for ids, _, final in done:
                assert len(ids) == max_tokens and final.finish_reason == "length"
            # Room for at least the two placed per worker and the two queued.
            assert len(done) >= 4
            st = wait_idle(c, flood_cluster, timeout=30)
            # NOTE: by the queue bound, or by admission's projection (no drain observed yet, or a
            # projected start past max_queue_wait_s): every refusal is counted under one reason.
            rejected = sum(st.router.rejections_total.values())
            assert rejected == len(errors)
            assert st.router.max_queue_requests == 2


# ---- client retries (scripted server) ------------------------------------------------------------------
class _Scripted(serving_pb2_grpc.KVServeServicer):
    """Refuses the first ``refusals`` Generates with RESOURCE_EXHAUSTED (+ retry-after-ms), then
    streams two messages; ``refuse_mid_stream`` refuses after the first message instead."""

    def __init__(self, refusals: int, retry_after_ms: str | None = "40", refuse_mid_stream: bool = False) -> None:
        self.refusals, self.retry_after_ms, self.refuse_mid_stream = refusals, retry_after_ms, refuse_mid_stream
        self.calls: list[float] = []

    def _refuse(self, context) -> None:
        if self.retry_after_ms is not None:
            context.set_trailing_metadata((("retry-after-ms", self.retry_after_ms),))
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "router queue full")

    def Generate(self, request, context):  # noqa: N802
        self.calls.append(time.monotonic())
        if len(self.calls) <= self.refusals and not self.refuse_mid_stream:
            self._refuse(context)
        yield spb.GenerateResponse(request_id=request.request_id or "r1", token_ids=[1, 2], text_delta="ab")
        if self.refuse_mid_stream:
            self._refuse(context)
        yield spb.GenerateResponse(request_id=request.request_id or "r1", token_ids=[3], text_delta="c",
                                   finish_reason="length")  # fmt: skip


@pytest.fixture
def scripted():
    servers = []

    def serve(servicer: _Scripted) -> str:
        server = grpc.server(cf.ThreadPoolExecutor(4))
        serving_pb2_grpc.add_KVServeServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield serve
    for s in servers:
        s.stop(None)


def test_client_retries_resource_exhausted_after_retry_after(scripted):
    servicer = _Scripted(refusals=2, retry_after_ms="60")
    with KVServeClient(scripted(servicer), timeout=10) as c:
        ids, text, final = c.generate_all([1, 2, 3])
    assert (ids, text, final.finish_reason) == ([1, 2, 3], "abc", "length")
    assert len(servicer.calls) == 3
    gaps = [b - a for a, b in zip(servicer.calls, servicer.calls[1:], strict=False)]
    assert all(g >= 0.06 for g in gaps), gaps


def test_client_retry_attempts_are_bounded(scripted):
    servicer = _Scripted(refusals=10)
    with KVServeClient(scripted(servicer), timeout=10, max_attempts=3) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.generate_all([1])
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert retry_after_s(e.value) == pytest.approx(0.04)
    assert len(servicer.calls) == 3


def test_client_never_retries_after_a_token_arrived(scripted):
    servicer = _Scripted(refusals=0, refuse_mid_stream=True)
    with KVServeClient(scripted(servicer), timeout=10) as c:
        stream = c.generate([1])
        assert list(next(stream).token_ids) == [1, 2]
        with pytest.raises(grpc.RpcError) as e:
            next(stream)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert len(servicer.calls) == 1


def test_client_gives_up_when_asked_to_wait_too_long(scripted):
    servicer = _Scripted(refusals=1, retry_after_ms="30000")
    with KVServeClient(scripted(servicer), timeout=10, max_retry_wait_s=1.0) as c:
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            c.generate_all([1])
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert time.monotonic() - t0 < 1.0 and len(servicer.calls) == 1
    # Nor past its own deadline.
    servicer = _Scripted(refusals=1, retry_after_ms="2000")
    with KVServeClient(scripted(servicer), timeout=0.5) as c, pytest.raises(grpc.RpcError):
        c.generate_all([1])
    assert len(servicer.calls) == 1


def test_client_backs_off_without_a_trailer(scripted):
    servicer = _Scripted(refusals=2, retry_after_ms=None)
    with KVServeClient(scripted(servicer), timeout=10) as c:
        assert c.generate_all([1])[0] == [1, 2, 3]
    assert len(servicer.calls) == 3


def test_async_client_retries_too(scripted):
    servicer = _Scripted(refusals=2, retry_after_ms="30")
    address = scripted(servicer)

    async def run():
        async with AsyncKVServeClient(address, timeout=10, max_attempts=3) as ac:
            return await ac.generate_all([1])

    ids, text, final = asyncio.run(run())
    assert ids == [1, 2, 3] and text == "abc" and final.finish_reason == "length"
    assert len(servicer.calls) == 3

    servicer = _Scripted(refusals=5)
    address = scripted(servicer)

    async def run_bounded():
        async with AsyncKVServeClient(address, timeout=10, max_attempts=2) as ac:
            return await ac.generate_all([1])

    with pytest.raises(grpc.RpcError) as e:
        asyncio.run(run_bounded())
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and len(servicer.calls) == 2


def test_client_rejects_a_non_prompt():
    with KVServeClient("127.0.0.1:1") as c:
        with pytest.raises(TypeError):
            c.generate(3.5)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            c.generate([1, "2"])  # type: ignore[list-item]
    with pytest.raises(ValueError):
        KVServeClient("127.0.0.1:1", tls_cert="x.pem")


# ---- auth ---------------------------------------------------------------------------------------------
TOKEN = "s3cret-test-token"


@pytest.fixture(scope="class")
def auth_cluster(ray_session, tiny_llama_dir):
    cl = start(tiny_llama_dir, num_workers=1, blocks=32, auth_token=TOKEN)
    yield cl
    cl.shutdown()


class TestAuth:
    @pytest.mark.parametrize("token", [None, "wrong", TOKEN + "x", TOKEN[:-1], ""])
    def test_missing_or_wrong_token_is_unauthenticated(self, auth_cluster, token):
        with KVServeClient(auth_cluster.address, auth_token=token, timeout=10) as c:
            calls = {
                "Generate": lambda: c.generate_all([1, 2], max_tokens=1),
                "Abort": lambda: c.abort("x"),
                "GetClusterStatus": c.status,
                "WatchBlockPressure": lambda: next(iter(c.watch(100, timeout=10))),
            }
            for name, call in calls.items():
                with pytest.raises(grpc.RpcError) as e:
                    call()
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, name

    def test_right_token_serves(self, auth_cluster):
        # The worker joined with the same token (its WorkerLink would be refused otherwise).
        with KVServeClient(auth_cluster.address, auth_token=TOKEN, timeout=RPC_TIMEOUT) as c:
            ids, _, final = c.generate_all([1, 2, 3], max_tokens=4)
            assert len(ids) == 4 and final.worker_id == "worker-0"
            assert c.abort("unknown") is False
            wait_idle(c, auth_cluster)

    def test_health_and_reflection_need_no_token(self, auth_cluster):
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

        with grpc.insecure_channel(auth_cluster.address) as ch:
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            services = set(ProtoReflectionDescriptorDatabase(ch).get_services())
            assert {"kvserve.v1.KVServe", "grpc.health.v1.Health"} <= services
            # ... and what reflection serves is the API, not a way around the token.
            stub = serving_pb2_grpc.KVServeStub(ch)
            with pytest.raises(grpc.RpcError) as e:
                stub.GetClusterStatus(spb.ClusterStatusRequest(), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


# ---- TLS ------------------------------------------------------------------------------------------
def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_pki(d: Path, ca_name: str = "ca") -> dict[str, str]:
    """A test CA, a server certificate for 127.0.0.1/localhost and a client certificate (EC P-256)."""
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", *ec, "-keyout", f"{ca_name}.key", "-out", f"{ca_name}.pem", "-days", "2",
             "-subj", f"/CN=kvserve test {ca_name}", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)  # fmt: skip
    out = {"ca": str(d / f"{ca_name}.pem")}
    for name, ext in (
        ("server", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"),
        ("client", "extendedKeyUsage=clientAuth\n"),
    ):
        (d / f"{name}.ext").write_text(ext)
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=kvserve-{name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca_name}.pem", "-CAkey", f"{ca_name}.key",
                 "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)  # fmt: skip
        out[f"{name}_cert"], out[f"{name}_key"] = str(d / f"{name}.pem"), str(d / f"{name}.key")
    return out


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, str]:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory) -> str:
    return make_pki(tmp_path_factory.mktemp("pki_other"), "other")["ca"]


@pytest.fixture(scope="class")
def tls_cluster(ray_session, tiny_llama_dir, pki):
    cl = start(
        tiny_llama_dir, num_workers=1, blocks=32, tls_cert=pki["server_cert"], tls_key=pki["server_key"],
        worker_options=WorkerOptions(tls_ca=pki["ca"]),
    )  # fmt: skip
    yield cl
    cl.shutdown()


class TestTLS:
    """Server TLS; the client verifies the router's certificate against the test CA."""

    def test_tls_round_trip(self, tls_cluster, pki, llm):
        prompt = rand_prompt(1100, 20)
        (expected,) = greedy(llm, [prompt], 6)
        with KVServeClient(tls_cluster.address, tls_ca=pki["ca"], timeout=RPC_TIMEOUT) as c:
            ids, _, final = c.generate_all(prompt, max_tokens=6, ignore_eos=True)
            assert ids == expected.token_ids and final.finish_reason == "length"
            assert len(c.status().workers) == 1
            wait_idle(c, tls_cluster)

    def test_client_refuses_an_untrusted_server_and_plaintext_fails(self, tls_cluster, other_ca):
        with KVServeClient(tls_cluster.address, tls_ca=other_ca, timeout=10) as c, pytest.raises(grpc.RpcError) as e:
            c.status()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        with KVServeClient(tls_cluster.address, timeout=10) as c, pytest.raises(grpc.RpcError) as e:
            c.status()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.fixture(scope="class")
def mtls_cluster(ray_session, tiny_llama_dir, pki):
    cl = start(
        tiny_llama_dir, num_workers=1, blocks=32, tls_cert=pki["server_cert"], tls_key=pki["server_key"],
        tls_client_ca=pki["ca"],
        worker_options=WorkerOptions(tls_ca=pki["ca"], tls_cert=pki["client_cert"], tls_key=pki["client_key"]),
    )  # fmt: skip
    yield cl
    cl.shutdown()


class TestMutualTLS:
    """mTLS: the router requires a client certificate from the test CA (workers present one too)."""

    def test_mtls_round_trip_and_refusal_without_a_client_certificate(self, mtls_cluster, pki):
        with KVServeClient(
            mtls_cluster.address, tls_ca=pki["ca"], tls_cert=pki["client_cert"], tls_key=pki["client_key"],
            timeout=RPC_TIMEOUT,
        ) as c:  # fmt: skip
            ids, _, final = c.generate_all([4, 5, 6], max_tokens=3)
            assert len(ids) == 3 and final.finish_reason == "length"
            wait_idle(c, mtls_cluster)
        with KVServeClient(mtls_cluster.address, tls_ca=pki["ca"], timeout=10) as c, pytest.raises(grpc.RpcError) as e:
            c.status()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
