"""Load one rank's shard from an HF safetensors checkpoint, reading only its slices (``get_slice``):
a rank never materialises the whole model, so per-rank memory is its shard plus the replicated norms."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from kvserve.workers.models.loader import WeightFiller, checkpoint_files, empty_model
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
    model = empty_model(lambda: ShardedCausalLM(plan, max_positions or full.max_position_embeddings), dtype, device)
    filler = WeightFiller(model, dtype)
    with torch.no_grad():
        # targets are offsets in the rank's (fused) parameters
        for f, handle, name, (param, offset, rows) in filler.safetensors(checkpoint_files(model_dir)):
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                rows = plan.vocab_real_rows  # the last rank's padding rows stay zero
                param[rows:].zero_()
                filler.count(param, param.shape[0] - rows)
            filler.copy(f, name, (param, offset, rows), _read_slice(handle, name, plan))
    filler.check_complete(model_dir)
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
