"""The KV pool's sizing on CUDA leaves room for the decode graphs' static inputs (``DecodeBuffers``): their block
tables are as wide as the longest sequence, so at 256 rows x 8,192 blocks they hold ~17 MB that
``gpu_memory_utilization`` must still cover (issue 37: the pool sizing accounts for the graphs)."""

from __future__ import annotations

import torch

from kvserve.workers.engine import memory_budget
from kvserve.workers.engine.config import EngineConfig
from kvserve.workers.engine.cuda_graphs import decode_buckets
from kvserve.workers.engine.input_buffers import DecodeBuffers
from kvserve.workers.engine.memory_budget import CudaMemory, ProfileShape, profile_kv_blocks


def _device_storage_bytes(buffers: DecodeBuffers) -> int:
    """Bytes of every distinct storage a ``DecodeBuffers`` holds but its host staging (``_h*``, and what aliases
    it: on CPU the delta's device buffer is its staging)."""
    host = {t.untyped_storage().data_ptr() for name, t in vars(buffers).items()
            if name.startswith("_h") and isinstance(t, torch.Tensor)}  # fmt: skip
    seen: dict[int, int] = {}
    for t in vars(buffers).values():
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in host:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def test_device_bytes_is_what_the_buffers_allocate() -> None:
    for rows, blocks in ((1, 1), (8, 64), (256, 300)):
        buffers = DecodeBuffers(rows, blocks, torch.device("cpu"))
        assert DecodeBuffers.device_bytes(rows, blocks) == _device_storage_bytes(buffers), (rows, blocks)


def test_the_profile_shape_counts_them_unless_eager() -> None:
    config = EngineConfig(model="unused", block_size=16, max_num_seqs=256)
    shape = ProfileShape.of(config, torch.bfloat16, max_model_len=131072)
    width = 131072 // 16
    assert shape.graph_batch == decode_buckets(256)[-1]
    assert shape.graph_buffer_bytes == DecodeBuffers.device_bytes(shape.graph_batch, width) > 16 * 2**20
    eager = ProfileShape.of(EngineConfig(model="unused", enforce_eager=True), torch.bfloat16, max_model_len=4096)
    assert eager.graph_batch == eager.graph_buffer_bytes == 0


class _Meter:
    def start_peak(self) -> int:
        return 0

    def peak_since(self, start: int) -> int:
        return 0

    def free_total(self) -> tuple[int, int]:
        return 10 * 2**30, 10 * 2**30


def test_the_kv_pool_leaves_room_for_them(monkeypatch) -> None:  # noqa: ANN001 - pytest's fixture
    monkeypatch.setattr(memory_budget, "_probe_peak", lambda meter, model, shape, counts: 1000)
    model = torch.nn.Linear(2, 2)
    shape = ProfileShape(16, torch.bfloat16, 0.9, 512, graph_batch=256, graph_buffer_bytes=5 * 2**20)
    memory, _ = profile_kv_blocks(_Meter(), model, shape, block_bytes=2**20)
    assert isinstance(memory, CudaMemory) and memory.graphs == 1000 + 5 * 2**20
