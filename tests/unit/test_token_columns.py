"""Plain decode tokens as columns, end to end on fake workers (no Ray, no gRPC): a worker's step puts its
plain outputs in ``DecodeColumns``, its outbox keeps them in order when it folds steps, the router's fast
path delivers them as ``TokenColumns`` entries, and a client applying a batch's columns, then its
responses, sees exactly what the general path (one ``RequestOutput`` and one response per request)
gives: same tokens, text, workers and finish, same metrics, same slow-consumer outcome."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any

import grpc
import pytest

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.router.observe import metrics
from kvserve.router.requests.mux import StreamMux, batch_responses, stream_batches
from kvserve.router.requests.request import RouterError
from kvserve.workers.core.step_columns import append_entry, column_entries
from kvserve.workers.engine.outputs import RequestOutput
from kvserve.workers.transport.outbox import Outbox
from kvserve.workers.transport.worker import _step_outputs
from tests.unit.test_router_failover import _commands, _req, _router, _settle

# ---- the worker's side ----------------------------------------------------------------------------


def _engine_out(rid: str, ids: tuple[int, ...], total: int, **kw: Any) -> RequestOutput:
    return RequestOutput(rid, ids, kw.pop("text", "t"), kw.pop("finish", None), 4, 0, total, **kw)


def test_a_step_sends_its_plain_outputs_as_columns_and_the_rest_as_messages() -> None:
    msg = _step_outputs(7, [
        _engine_out("plain", (5,), 3, text="a"),
        _engine_out("two", (6, 7), 5, text="bc"),
        _engine_out("final", (8,), 9, finish="length"),
        _engine_out("logprobs", (9,), 2, new_logprobs=({9: -0.1},)),
        _engine_out("preempted", (1,), 4, num_preemptions=1),
        _engine_out("swapped", (1,), 4, num_swaps=1),
        _engine_out("no-token", (), 4, text=""),
    ])  # fmt: skip
    assert msg.decode_step == 7
    assert list(column_entries(msg.columns)) == [("plain", [5], 3, "a"), ("two", [6, 7], 5, "bc")]
    assert [o.request_id for o in msg.outputs] == ["final", "logprobs", "preempted", "swapped", "no-token"]
    assert msg.outputs[0].finish_reason == "length" and msg.outputs[2].num_preemptions == 1


def _columns_step(step: int, *entries: tuple[str, list[int], int], outputs: tuple[pb.RequestOutput, ...] = ()
                  ) -> pb.StepOutputs:  # fmt: skip
    msg = pb.StepOutputs(decode_step=step, outputs=outputs)
    for rid, ids, total in entries:
        append_entry(msg.columns, rid, ids, total, f"<{step}>")
    return msg


def _applied(step: pb.StepOutputs) -> dict[str, list[tuple[list[int], int, str, str]]]:
    """Per request, what a reader applies in order: the columns, then the outputs."""
    seen: dict[str, list] = defaultdict(list)
    for rid, ids, total, text in column_entries(step.columns):
        seen[rid].append((ids, total, text, ""))
    for o in step.outputs:
        seen[o.request_id].append((list(o.new_token_ids), o.num_output_tokens, o.text_delta, o.finish_reason))
    return seen


def test_folded_steps_keep_each_requests_tokens_in_order() -> None:
    box = Outbox()
    box.open_stream([])  # connected; nothing taken, so every step folds into the first message
    first = pb.RequestOutput(request_id="c", new_token_ids=[30], num_output_tokens=1, text_delta="<1>")
    box.put_step(_columns_step(1, ("a", [10], 1), ("b", [20], 1), outputs=(first,)), None, None)
    finish_b = pb.RequestOutput(request_id="b", new_token_ids=[21], num_output_tokens=2, text_delta="<2>",
                                finish_reason="length")  # fmt: skip
    box.put_step(_columns_step(2, ("a", [11], 2), ("c", [31], 2), outputs=(finish_b,)), None, None)
    box.put_step(_columns_step(3, ("a", [12, 13], 4), ("c", [32], 3)), None, None)
    (msg,) = box._log
    seen = _applied(msg.step.outputs)
    # a: columns only, one entry per step, in order
    assert seen["a"] == [([10], 1, "<1>", ""), ([11], 2, "<2>", ""), ([12, 13], 4, "<3>", "")]
    # b: its column entry is read before its final output
    assert seen["b"] == [([20], 1, "<1>", ""), ([21], 2, "<2>", "length")]
    # c had an output in the first step: its later entries fold into it, so they stay after it
    assert seen["c"] == [([30, 31, 32], 3, "<1><2><3>", "")]


# ---- the router's side ----------------------------------------------------------------------------


def _message(columns: bool, step: int, *outs: tuple[str, list[int], int, str]) -> pb.WorkerMessage:
    """One worker step: ``(worker rid, new ids, num_output_tokens, finish)`` per output, the plain
    ones as columns when ``columns`` (as a worker sends them), else all as messages."""
    msg = pb.StepOutputs(decode_step=step)
    for rid, ids, total, finish in outs:
        if columns and not finish:
            append_entry(msg.columns, rid, ids, total, f"<{step}:{total}>")
        else:
            msg.outputs.append(pb.RequestOutput(request_id=rid, new_token_ids=ids, num_output_tokens=total,
                                                text_delta=f"<{step}:{total}>", finish_reason=finish))  # fmt: skip
    return pb.WorkerMessage(step=pb.StepMessages(outputs=msg))


class _Client:
    """A GenerateStream client: applies each batch's responses (columns first) per request."""

    def __init__(self) -> None:
        self.seen: dict[str, list[tuple[tuple[int, ...], str, str, str]]] = defaultdict(list)
        self.errors: dict[str, int] = {}
        self.column_entries = 0

    def read(self, batch: spb.GenerateBatch) -> None:
        self.column_entries += len(batch.columns.request_ids)
        for resp in batch_responses(batch):
            self.seen[resp.request_id].append((tuple(resp.token_ids), resp.text_delta, resp.worker_id,
                                               resp.finish_reason))  # fmt: skip
        for err in batch.errors:
            self.errors[err.request_id] = err.code

    def stream(self) -> dict[str, tuple[list[int], str, list[str], str]]:
        """Per request: every token, all text, the worker of each token, the finish reason."""
        out = {}
        for rid, items in self.seen.items():
            out[rid] = ([t for ids, *_ in items for t in ids], "".join(text for _, text, _, _ in items),
                        [w for ids, _, w, _ in items for _ in ids], next((f for *_, f in items if f), ""))  # fmt: skip
        return out


def _generation_tokens() -> float:
    return metrics.GENERATION_TOKENS._value


def _itl_count() -> int:
    return sum(metrics.ITL._counts)


async def _scenario(columns: bool, stream: str) -> tuple[_Client, float, int]:
    """Two requests through first tokens, plain steps, steps folded into one message, a migration
    whose destination's first tokens arrive before the source's last one, a resend, and finishes.

    ``columns``: the worker sends its plain outputs as columns; ``stream``: the requests share a
    GenerateStream whose client reads columns ("columns") or not ("mux"), or each has its own
    response queue, as a Generate call or the HTTP API ("queues")."""
    router, _ = _router()
    mux = StreamMux(columns=stream == "columns") if stream != "queues" else None
    r1 = router.submit(_req("r1", max_tokens=8), mux=mux)
    r2 = router.submit(_req("r2", max_tokens=8), mux=mux)
    await _settle()
    client = _Client()
    tokens0, itl0 = _generation_tokens(), _itl_count()
    w1, w2 = r1.worker_id, r2.worker_id
    assert w1 is not None and w2 is not None
    a, b = r1.worker_rid, r2.worker_rid
    dst = "b" if w1 == "a" else "a"

    def send(worker: str, step: int, *outs: tuple[str, list[int], int, str]) -> None:
        router.on_message(worker, _message(columns, step, *outs))

    def read() -> None:
        if mux is not None:
            client.read(mux.take())
            return
        for r in (r1, r2):
            client.read(spb.GenerateBatch(responses=[r.responses.get_nowait() for _ in range(r.responses.qsize())]))

    send(w1, 1, (a, [10], 1, ""))  # first tokens: TTFT, the general path in both modes
    send(w2, 1, (b, [20], 1, ""))
    read()
    send(w1, 2, (a, [11], 2, ""))
    read()
    send(w1, 3, (a, [12], 3, ""))
    send(w2, 2, (b, [21, 22], 3, ""))  # two tokens in one entry (a folded step)
    send(w1, 4, (a, [13], 4, ""))  # not taken in between: the batch holds two entries of r1
    read()
    r1.dispatch_workers.add(dst)  # a migration's import: the destination's outputs count from now on
    send(dst, 1, (a, [15], 6, ""))  # the destination overtakes the source's last token: held
    send(w1, 5, (a, [14], 5, ""))  # ... which releases it
    send(w1, 5, (a, [14], 5, ""))  # a resend of a delivered token: dropped
    read()
    send(dst, 2, (a, [16], 7, ""), (a, [17], 8, "length"))
    send(w2, 3, (b, [23], 4, ""))
    send(w2, 4, (b, [24], 5, "stop"))  # in the same batch as r2's last plain entry
    read()
    assert not router.requests
    return client, _generation_tokens() - tokens0, _itl_count() - itl0


@pytest.mark.parametrize("stream", ["columns", "mux", "queues"])
def test_the_fast_path_delivers_what_the_general_path_does(stream: str) -> None:
    fast, fast_tokens, fast_itl = asyncio.run(_scenario(columns=True, stream=stream))
    general, general_tokens, general_itl = asyncio.run(_scenario(columns=False, stream="mux"))
    assert (fast.column_entries > 0) == (stream == "columns") and general.column_entries == 0
    assert fast.stream() == general.stream()
    assert fast.stream()["r1"][0] == [10, 11, 12, 13, 14, 15, 16, 17]
    assert fast.stream()["r2"][0] == [20, 21, 22, 23, 24] and fast.stream()["r2"][3] == "stop"
    assert (fast_tokens, fast_itl) == (general_tokens, general_itl) == (13, 10)


@pytest.mark.parametrize("stream", ["columns", "mux", "queues"])
def test_a_client_that_stops_reading_is_cut_off_on_the_fast_path(stream: str) -> None:
    async def test() -> None:
        router, _ = _router(max_buffered_responses=3)
        mux = StreamMux(columns=stream == "columns") if stream != "queues" else None
        r = router.submit(_req("r1", max_tokens=16), mux=mux)
        await _settle()
        w, rid = r.worker_id, r.worker_rid
        assert w is not None
        router.on_message(w, _message(True, 1, (rid, [10], 1, "")))
        client = _Client()
        if mux is not None:
            client.read(mux.take())
        else:
            client.read(spb.GenerateBatch(responses=[r.responses.get_nowait()]))
        for step in range(2, 7):  # nobody reads: the stream's client is not reading
            router.on_message(w, _message(True, step, (rid, [8 + step], step, "")))
        assert "r1" not in router.requests
        assert any(c.HasField("abort") and c.abort.request_id == rid for c in _commands(router, w))
        if mux is not None:
            client.read(mux.take())
            assert client.errors == {"r1": grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]}
        else:
            (error,) = [r.responses.get_nowait() for _ in range(r.responses.qsize())]
            assert isinstance(error, RouterError) and error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert client.stream()["r1"][0] == [10]  # the unread backlog was dropped

    asyncio.run(test())


@pytest.mark.parametrize("columns", [True, False], ids=["columns", "responses"])
def test_a_replays_first_tokens_release_its_promised_blocks_on_either_path(columns: bool) -> None:
    """A replay's first output already has tokens before it (the fast path's case): it still marks the
    new dispatch started, so the worker's next report takes over the blocks promised for it."""

    async def test() -> None:
        router, _ = _router()
        mux = StreamMux(columns=columns)
        r = router.submit(_req("r1", max_tokens=8), mux=mux)
        await _settle()
        src, first = r.worker_id, r.worker_rid
        assert src is not None
        router.on_message(src, _message(columns, 1, (first, [10], 1, "")))
        client = _Client()
        client.read(mux.take())
        router.on_disconnect(src)
        await _settle()
        dst, rid = r.worker_id, r.worker_rid
        assert dst not in (None, src) and rid != first and rid in router.table[dst].in_flight
        router.on_message(dst, _message(columns, 1, (rid, [11], 2, "")))
        report = pb.PressureReport(seq=1, total_blocks=32, free_blocks=30, used_blocks=2, num_running=1)
        router.on_message(dst, pb.WorkerMessage(step=pb.StepMessages(pressure=report)))
        assert rid not in router.table[dst].in_flight  # NOTE: else counted twice: promised and reported
        client.read(mux.take())
        assert client.stream()["r1"][0] == [10, 11] and client.column_entries == (1 if columns else 0)

    asyncio.run(test())


# ---- the stream's side ----------------------------------------------------------------------------


def test_a_request_with_a_response_in_the_batch_gets_its_later_tokens_there() -> None:
    async def test() -> None:
        mux = StreamMux(columns=True)
        mux.put_plain("w0", "a", [1], "x")
        mux.put("b", {"request_id": "b", "token_ids": [7], "text_delta": "p", "worker_id": "w0"})
        mux.put_plain("w0", "b", [8], "q")  # NOTE: a column entry would be read before b's response
        mux.put_plain("w1", "a", [2], "y")
        mux.put("a", {"request_id": "a", "token_ids": [3], "text_delta": "z", "worker_id": "w1",
                      "finish_reason": "stop"})  # fmt: skip
        assert mux.unsent("a") == 3 and mux.unsent("b") == 2
        batch = mux.take()
        assert list(batch.columns.worker_ids) == ["w0", "w1"] and list(batch.columns.request_ids) == ["a", "a"]
        assert [(r.request_id, list(r.token_ids), r.worker_id, r.finish_reason) for r in batch_responses(batch)] == [
            ("a", [1], "w0", ""), ("a", [2], "w1", ""), ("b", [7, 8], "w0", ""), ("a", [3], "w1", "stop")]  # fmt: skip
        assert mux.unsent("a") == 0

    asyncio.run(test())


def test_a_dropped_request_leaves_no_column_entry_and_ids_are_renamed_on_the_way_out() -> None:
    async def test() -> None:
        mux = StreamMux(columns=True)
        a, b = mux.slot("t1:a"), mux.slot("t1:b")
        mux.put_plain("w0", "t1:a", [1, 2], "xy")
        mux.put_plain("w0", "t1:b", [5], "q")
        mux.put_plain("w0", "t1:a", [3], "z")
        b.get_nowait()  # the router dropped b's backlog (slow consumer)
        b.put_nowait(RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED, "too slow"))
        assert a.qsize() == 2 and b.qsize() == 1
        live = {"a": object(), "b": object()}
        reader = asyncio.get_running_loop().create_future()
        batches = stream_batches(mux, live, reader, rename=lambda rid: rid.removeprefix("t1:"))
        batch = await anext(batches)
        assert list(_responses_of(batch)) == [("a", [1, 2], "xy"), ("a", [3], "z")]
        assert [e.request_id for e in batch.errors] == ["b"] and set(live) == {"a"}
        reader.cancel()

    asyncio.run(test())


def _responses_of(batch: spb.GenerateBatch) -> list[tuple[str, list[int], str]]:
    return [(r.request_id, list(r.token_ids), r.text_delta) for r in batch_responses(batch)]
