"""The frontend's side of a resume (docs/architecture.md 2a "Resuming through another frontend";
kvserve/frontend/owned.py ``trim``): a taken-over request's worker resends its whole output from token 0, and the
new owner delivers only what follows its client's cursor (tokens and text characters), then everything as it comes."""

from __future__ import annotations

from kvserve.frontend.owned import OwnedRequests
from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.protos.kvserve.v1 import worker_pb2 as pb


class _Relayed:
    request_id = "req-1"
    finished = False

    def __init__(self) -> None:
        self.got: list[spb.GenerateResponse] = []
        self.ended_ = False

    def put(self, item: spb.GenerateResponse) -> None:
        self.got.append(item)

    def ended(self) -> None:
        self.ended_ = True


def _out(ids: list[int], text: str, total: int, finish: str = "", prompt: int = 0) -> pb.RequestOutput:
    return pb.RequestOutput(request_id="k2#3", new_token_ids=ids, text_delta=text, num_output_tokens=total,
                            finish_reason=finish, num_prompt_tokens=prompt)  # fmt: skip


def _taken_over(cursor: tuple[int, int]) -> tuple[OwnedRequests, _Relayed]:
    owned, rr = OwnedRequests(), _Relayed()
    owned.register("k2", rr, []).cursor = cursor  # type: ignore[arg-type]
    return owned, rr


def test_the_catch_up_is_cut_at_the_clients_cursor_and_later_outputs_pass_whole() -> None:
    owned, rr = _taken_over((3, 4))
    owned.on_output("w", _out([10, 11, 12, 13, 14], "abcdefg", 5), 0.0)
    owned.on_output("w", _out([15], "h", 6), 0.0)
    owned.on_output("w", _out([16], "ij", 7, finish="length", prompt=9), 0.0)
    assert [list(r.token_ids) for r in rr.got] == [[13, 14], [15], [16]]
    assert [r.text_delta for r in rr.got] == ["efg", "h", "ij"]
    final = rr.got[-1]
    assert final.finish_reason == "length" and final.usage.completion_tokens == 7 and final.usage.prompt_tokens == 9
    assert rr.ended_ and "k2" not in owned.states
    assert owned.states == {} and owned.replayed("k2") is None


def test_a_catch_up_the_client_already_has_in_full_delivers_nothing_until_the_next_token() -> None:
    owned, rr = _taken_over((5, 7))
    owned.on_output("w", _out([10, 11, 12, 13, 14], "abcdefg", 5), 0.0)
    assert rr.got == []
    owned.on_output("w", _out([15], "h", 6), 0.0)
    assert [(list(r.token_ids), r.text_delta) for r in rr.got] == [([15], "h")]


def test_the_new_owner_holds_every_token_for_a_later_replays_resume() -> None:
    owned, rr = _taken_over((4, 4))
    owned.on_output("w", _out([10, 11, 12, 13, 14], "abcde", 5), 0.0)
    assert [list(r.token_ids) for r in rr.got] == [[14]]
    assert owned.replayed("k2") == [10, 11, 12, 13, 14], "a Resume carries the request's whole output"
