"""The demo's chat workload and its plain-text / live rendering (no cluster: kvserve/cluster/demo.py's pure parts)."""

from __future__ import annotations

import grpc
from rich.console import Console

from kvserve.cluster.demo import (
    PressureTracker,
    RequestResult,
    _grpc_request,
    build_chat_workload,
    build_workload,
    summarize,
)
from kvserve.cluster.demo_chat import QUESTIONS, SYSTEM_PROMPT, AnswerBoard, format_exchange
from kvserve.protos.kvserve.v1 import pressure_pb2 as ppb
from kvserve.protos.kvserve.v1 import serving_pb2 as spb


def test_chat_workload_shares_the_system_prompt_and_asks_distinct_questions() -> None:
    workload = build_chat_workload(len(QUESTIONS) + 2)
    assert all(r.messages[0] == ("system", SYSTEM_PROMPT) for r in workload)
    assert [r.question for r in workload[: len(QUESTIONS)]] == list(QUESTIONS)
    assert workload[len(QUESTIONS)].question == QUESTIONS[0], "more users than questions: they cycle"
    grpc_req = _grpc_request(workload[0])
    assert grpc_req.WhichOneof("prompt") == "messages"
    assert [(m.role, m.content) for m in grpc_req.messages.messages] == list(workload[0].messages)
    assert not grpc_req.sampling.ignore_eos, "a real answer ends at the model's end of turn"


def test_random_workload_still_sends_token_ids() -> None:
    req = _grpc_request(build_workload(1)[0])
    assert req.WhichOneof("prompt") == "token_ids" and req.sampling.ignore_eos


def test_answer_board_streams_and_renders() -> None:
    board = AnswerBoard({0: "What is the capital of France?", 1: "Why is the sky blue?"})
    board.append(0, "The capital")
    board.append(0, " of France is Paris.")
    board.finish(0)
    board.append(1, "Because of\nRayleigh scattering")
    console = Console(width=100, record=True, color_system=None)
    console.print(board.render(100))
    text = console.export_text()
    assert "The capital of France is Paris." in text
    assert "Because of Rayleigh scattering ▌" in text, "whitespace folded; a cursor while it streams"
    assert "Paris. ▌" not in text, "no cursor once finished"


def test_format_exchange_wraps_under_its_labels() -> None:
    out = format_exchange("Why?", "word " * 40, width=40)
    lines = out.splitlines()
    assert lines[0] == "    Q: Why?" and lines[1].startswith("    A: word")
    assert all(len(ln) <= 40 for ln in lines) and all(ln.startswith("      ") for ln in lines[2:])


def test_summary_of_a_chat_run() -> None:
    workload = build_chat_workload(2)
    results = [
        RequestResult(workload[0], ok=True, finish_reason="stop", prompt_tokens=100, cached_tokens=0, tokens=8),
        RequestResult(workload[1], ok=True, finish_reason="length", prompt_tokens=100, cached_tokens=80, tokens=64),
    ]
    worker = spb.WorkerStatus(worker_id="worker-0", report=ppb.PressureReport(total_blocks=32))
    status = spb.ClusterStatus(workers=[worker])
    tracker = PressureTracker()
    tracker.update(status)
    summary = summarize(results, status, tracker, 10.0, 1, 0.03, 32)
    assert "2 ok, 0 failed: 2 users' questions sharing a system prompt (1 answers ended by the model)" in summary
    assert "prefix cache   hit rate 40.0% of prompt tokens" in summary
    assert "1 workers x 32 KV blocks" in summary


class _Busy(grpc.RpcError):
    """What the router answers an overloaded Generate: RESOURCE_EXHAUSTED with a retry-after trailer."""

    def __init__(self, code: grpc.StatusCode = grpc.StatusCode.RESOURCE_EXHAUSTED) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "router busy"

    def trailing_metadata(self) -> tuple:
        return (("retry-after-ms", "1"),)


class _Stub:
    def __init__(self, failures: list[grpc.RpcError]) -> None:
        self.failures, self.calls = failures, 0

    def Generate(self, request, timeout, wait_for_ready=False):  # noqa: ANN001, N802 - the gRPC stub's name
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)
        yield spb.GenerateResponse(token_ids=[1, 2], finish_reason="length")


def test_demo_retries_an_overloaded_router_before_any_token() -> None:
    from kvserve.cluster.demo import DemoRequest, _send

    req = DemoRequest(index=1, kind="short", token_ids=(5, 6), max_tokens=2)
    stub = _Stub([_Busy(), _Busy()])
    result = _send(stub, req, on_tokens=lambda n: None)
    assert stub.calls == 3 and result.ok and result.tokens == 2 and result.error == ""
    # Any other status is the answer: no retry.
    stub = _Stub([_Busy(grpc.StatusCode.INVALID_ARGUMENT)])
    result = _send(stub, req, on_tokens=lambda n: None)
    assert stub.calls == 1 and not result.ok and result.error.startswith("INVALID_ARGUMENT")
