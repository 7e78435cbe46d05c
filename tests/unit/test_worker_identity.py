"""WorkerIdentity: the typed form of the WorkerLink Hello."""

from __future__ import annotations

import pickle

import pytest

from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.workers.core.identity import WorkerIdentity

IDENTITY = WorkerIdentity(
    "w0", "model", block_size=16, total_blocks=128, max_model_len=4096, vocab_size=32000,
    swap_blocks=64, has_tokenizer=True, node_id="node-1",
)  # fmt: skip


def test_hello_round_trip_keeps_every_field() -> None:
    hello = IDENTITY.to_hello("inc-1", last_command_seq=7)
    assert (hello.incarnation, hello.last_command_seq) == ("inc-1", 7)
    assert WorkerIdentity.from_hello(hello) == IDENTITY


def test_it_crosses_processes_by_pickle() -> None:  # Ray's ready() answer
    assert pickle.loads(pickle.dumps(IDENTITY)) == IDENTITY


@pytest.mark.parametrize("field", ["block_size", "total_blocks", "max_model_len", "vocab_size"])
def test_sizes_must_be_positive(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        WorkerIdentity(**{**IDENTITY.__dict__, field: 0})


def test_a_hello_without_sizes_is_refused() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        WorkerIdentity.from_hello(pb.Hello(worker_id="old", block_size=16, total_blocks=8, max_model_len=64))
