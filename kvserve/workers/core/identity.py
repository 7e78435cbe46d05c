"""A worker's identity and sizes: the typed Python form of the WorkerLink ``Hello``.

The worker builds its ``Hello`` from this (the wire shape) and returns this from the Ray
``ready()`` call (the process shape: protobuf messages of this package do not pickle). Nothing
else crosses between worker and router to describe a worker.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.protos.kvserve.v1 import worker_pb2 as pb


@dataclass(frozen=True)
class WorkerIdentity:
    """Who a worker is and the geometry of its KV pool.

    Attributes:
        worker_id: unique id in the cluster.
        model_id: the model it serves (prefix-cache hashes are salted with it).
        block_size: tokens per KV block.
        total_blocks: device KV blocks in its pool.
        swap_blocks: host swap space, in blocks (0 = none).
        max_model_len: longest sequence (prompt + output) it accepts.
        vocab_size: token ids it accepts are in ``[0, vocab_size)``.
        has_tokenizer: whether it can detokenize (text deltas).
        node_id: the Ray node it runs on ("" outside Ray).
        tensor_parallel_size: ranks of its tensor-parallel group (kvserve/workers/parallel); the pool is the group's.

    Raises:
        ValueError: a size out of range.
    """

    worker_id: str
    model_id: str
    block_size: int
    total_blocks: int
    max_model_len: int
    vocab_size: int
    swap_blocks: int = 0
    has_tokenizer: bool = False
    node_id: str = ""
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in ("block_size", "total_blocks", "max_model_len", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"worker {self.worker_id!r}: {name} must be positive, got {getattr(self, name)}")
        if self.swap_blocks < 0:
            raise ValueError(f"worker {self.worker_id!r}: swap_blocks must be >= 0, got {self.swap_blocks}")

    def to_hello(self, incarnation: str, last_command_seq: int = 0) -> pb.Hello:
        """The ``Hello`` of one WorkerLink connection."""
        return pb.Hello(
            worker_id=self.worker_id,
            model_id=self.model_id,
            block_size=self.block_size,
            total_blocks=self.total_blocks,
            swap_blocks=self.swap_blocks,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            has_tokenizer=self.has_tokenizer,
            node_id=self.node_id,
            incarnation=incarnation,
            last_command_seq=last_command_seq,
            tensor_parallel_size=self.tensor_parallel_size,
        )

    @classmethod
    def from_hello(cls, hello: pb.Hello) -> WorkerIdentity:
        """Raises ValueError when the Hello lacks a size (e.g. from a worker of an older version)."""
        return cls(
            worker_id=hello.worker_id,
            model_id=hello.model_id,
            block_size=hello.block_size,
            total_blocks=hello.total_blocks,
            max_model_len=hello.max_model_len,
            vocab_size=hello.vocab_size,
            swap_blocks=hello.swap_blocks,
            has_tokenizer=hello.has_tokenizer,
            node_id=hello.node_id,
            tensor_parallel_size=hello.tensor_parallel_size or 1,
        )
