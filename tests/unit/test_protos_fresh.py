"""The checked-in generated proto modules match what kvserve/protos/regen.py makes from the .proto files."""

from __future__ import annotations

import importlib
import re

import grpc
import pytest

pytest.importorskip("grpc_tools", reason="grpcio-tools (dev dependency) regenerates the protos")

from kvserve.protos import regen  # noqa: E402

# NOTE: the grpc modules carry the generator's version as the least grpcio they run on; a newer grpcio-tools
# stamps its own (1.85.4 vs the checked-in 1.85.1) with the same code. The stamp is compared apart: it must
# not exceed the grpcio installed here (an older stamp keeps the modules importable by older grpcio).
_STAMP = re.compile(r"^GRPC_GENERATED_VERSION = '([0-9.]+)'$", re.MULTILINE)


def _unstamped(text: str) -> str:
    return _STAMP.sub("GRPC_GENERATED_VERSION = ''", text)


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def test_checked_in_generated_files_are_fresh(tmp_path):
    fresh = {p.name: p.read_text() for p in regen.generate(tmp_path)}
    checked_in = {p.name: p.read_text() for p in regen.generated_files(regen.PROTO_ROOT)}

    assert sorted(checked_in) == sorted(fresh), "run `python kvserve/protos/regen.py` (files added or removed)"
    stale = [name for name in fresh if _unstamped(fresh[name]) != _unstamped(checked_in[name])]
    assert not stale, f"stale generated files {stale}: run `python kvserve/protos/regen.py`"
    installed = _version(grpc.__version__.split("rc")[0])
    for name, text in checked_in.items():
        for stamp in _STAMP.findall(text):
            assert _version(stamp) <= installed, f"{name} needs grpcio>={stamp}, {grpc.__version__} is installed"


def test_every_proto_has_generated_modules():
    names = {p.name for p in regen.generated_files(regen.PROTO_ROOT)}
    for proto in regen.proto_files():
        stem = proto.stem
        assert {f"{stem}_pb2.py", f"{stem}_pb2.pyi", f"{stem}_pb2_grpc.py"} <= names


@pytest.mark.parametrize("module", ["worker_pb2", "worker_pb2_grpc", "serving_pb2", "serving_pb2_grpc"])
def test_generated_modules_import_as_package(module):
    mod = importlib.import_module(f"kvserve.protos.kvserve.v1.{module}")
    assert mod.__name__ == f"kvserve.protos.kvserve.v1.{module}"


def test_wire_round_trip():
    from kvserve.protos.kvserve.v1 import serving_pb2, worker_pb2

    msg = worker_pb2.WorkerMessage(
        seq=7,
        block_events=worker_pb2.BlockEvents(
            events=[
                worker_pb2.BlockEvent(seq=1, stored=worker_pb2.BlockStored(hashes=[2**64 - 1, 3])),
                worker_pb2.BlockEvent(seq=2, cleared=worker_pb2.AllBlocksCleared()),
            ]
        ),
    )
    back = worker_pb2.WorkerMessage.FromString(msg.SerializeToString())
    assert back.WhichOneof("body") == "block_events"
    assert list(back.block_events.events[0].stored.hashes) == [2**64 - 1, 3]
    assert back.block_events.events[1].WhichOneof("kind") == "cleared"

    cmd = worker_pb2.RouterCommand(seq=1, preempt=worker_pb2.Preempt(request_id="r", mode=worker_pb2.Preempt.SWAP))
    assert worker_pb2.RouterCommand.FromString(cmd.SerializeToString()).preempt.mode == worker_pb2.Preempt.SWAP

    params = serving_pb2.SamplingParams(max_tokens=4)
    assert not params.HasField("seed") and not params.HasField("top_p")
    params.seed = 0
    assert params.HasField("seed")
