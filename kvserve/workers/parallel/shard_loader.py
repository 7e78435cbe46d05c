"""Load one rank's shard from an HF safetensors checkpoint, reading only its slices (``get_slice``):
a rank never materialises the whole model, so per-rank memory is its shard plus the replicated norms."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kvserve.workers.models.loader import _load_kv_scale, _targets, checkpoint_files
from kvserve.workers.models.model_config import ModelConfig
from kvserve.workers.parallel.layers import ShardedCausalLM
from kvserve.workers.parallel.sharding import ShardPlan

logger = logging.getLogger(__name__)


def load_shard(
    model_dir: str | Path,
    rank: int,
    size: int,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    max_positions: int | None = None,
) -> ShardedCausalLM:
    """Rank ``rank`` of ``size``'s ``ShardedCausalLM`` for ``model_dir``, filled from its safetensors.

    Raises:
        FileNotFoundError: missing config or weights.
        ValueError: GGUF checkpoint, a size that does not divide the model (``ShardPlan``), wrong shape,
            or a parameter never loaded.
    """
    from kvserve.workers.models.gguf_checkpoint import find_gguf

    model_dir = Path(model_dir)
    if find_gguf(model_dir) is not None:
        raise ValueError(f"{model_dir}: tensor parallelism loads safetensors checkpoints, not GGUF")
    full = ModelConfig.from_dir(model_dir)
    plan = ShardPlan(full, rank, size)
    dtype = dtype or full.dtype
    with torch.device(device):
        model = ShardedCausalLM(plan, max_positions or full.max_position_embeddings)
    model = model.to(dtype)
    model.rotary.float()  # NOTE: the cos/sin table stays fp32 (cast per use) as in HF.
    written: dict[int, int] = {}  # id(param) -> rows written
    with torch.no_grad():
        for f in checkpoint_files(model_dir):
            try:
                handle = safe_open(str(f), framework="pt", device="cpu")
            except (SafetensorError, OSError) as e:
                raise ValueError(f"{f}: cannot read safetensors ({e})") from e
            with handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if _load_kv_scale(model, name, handle):
                        continue
                    target = _targets(model, name)  # offsets in the rank's (fused) parameters
                    if target is None:
                        continue
                    param, offset, rows = target
                    tensor = _read_slice(handle, name, plan)
                    if name in ("model.embed_tokens.weight", "lm_head.weight"):
                        rows = plan.vocab_real_rows  # the last rank's padding rows stay zero
                        param[rows:].zero_()
                        written[id(param)] = written.get(id(param), 0) + param.shape[0] - rows
                    expected = (rows, *param.shape[1:])
                    if tuple(tensor.shape) != expected:
                        raise ValueError(f"{f}: {name} slice has shape {tuple(tensor.shape)}, expected {expected}")
                    param[offset : offset + rows].copy_(tensor.to(dtype))
                    written[id(param)] = written.get(id(param), 0) + rows
    missing = [n for n, p in model.named_parameters() if written.get(id(p), 0) != p.shape[0]]
    if missing:
        raise ValueError(f"{model_dir}: checkpoint lacks weights for {missing[:5]}{'...' if len(missing) > 5 else ''}")
    logger.info("loaded rank %d/%d of %s (%s, %d layers)", rank, size, full.architecture, dtype, full.num_layers)
    return model.eval()


def _read_slice(handle: object, name: str, plan: ShardPlan) -> torch.Tensor:
    """This rank's part of tensor ``name``, read from the file without loading the rest."""
    view = handle.get_slice(name)  # type: ignore[attr-defined]
    rows, cols = plan.rows(name), plan.cols(name)
    if rows is not None:
        return view[rows[0] : rows[1]]
    if cols is not None:
        return view[:, cols[0] : cols[1]]
    return view[:]
