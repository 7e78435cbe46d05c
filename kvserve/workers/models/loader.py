"""Load a HuggingFace Llama-family directory: config.json + (sharded) safetensors.

HF stores q/k/v and gate/up as separate tensors; our model fuses them, so the loader splices each
HF tensor into its slice of the fused parameter and checks that every parameter was written.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import SafetensorError, safe_open

from kvserve.workers.models.model import CausalLM
from kvserve.workers.models.model_config import ModelConfig

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

Target = tuple[torch.Tensor, int, int]  # (parameter, row offset, rows): where an HF tensor goes
M = TypeVar("M", bound=CausalLM)


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: single file or the shards named by the index."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index}: corrupt safetensors index ({e})") from e
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    elif (model_dir / "model.safetensors").is_file():
        files = [model_dir / "model.safetensors"]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights found")
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"{f}: shard named in the index is missing")
    return files


def _targets(model: CausalLM, name: str) -> Target | None:
    """Where an HF tensor goes: (parameter, row offset, rows) or None for tensors we do not use."""
    c = model.config
    if name == "model.embed_tokens.weight":
        return model.embed_tokens.weight, 0, c.vocab_size
    if name == "model.norm.weight":
        return model.norm.weight, 0, c.hidden_size
    if name == "lm_head.weight":
        return None if model.lm_head is None else (model.lm_head.weight, 0, c.vocab_size)
    m = _LAYER.match(name)
    if m is None:
        return None
    idx, rest = int(m.group(1)), m.group(2)
    if idx >= c.num_layers:
        return None
    layer = model.layers[idx]
    attn, mlp = layer.self_attn, layer.mlp
    q, kv, inter = c.q_size, c.kv_size, c.intermediate_size
    table: dict[str, Target] = {
        "self_attn.q_proj.weight": (attn.qkv_proj.weight, 0, q),
        "self_attn.k_proj.weight": (attn.qkv_proj.weight, q, kv),
        "self_attn.v_proj.weight": (attn.qkv_proj.weight, q + kv, kv),
        "self_attn.o_proj.weight": (attn.o_proj.weight, 0, c.hidden_size),
        "mlp.gate_proj.weight": (mlp.gate_up_proj.weight, 0, inter),
        "mlp.up_proj.weight": (mlp.gate_up_proj.weight, inter, inter),
        "mlp.down_proj.weight": (mlp.down_proj.weight, 0, c.hidden_size),
        "input_layernorm.weight": (layer.input_layernorm.weight, 0, c.hidden_size),
        "post_attention_layernorm.weight": (layer.post_attention_layernorm.weight, 0, c.hidden_size),
    }
    if attn.q_norm is not None and attn.k_norm is not None:
        table["self_attn.q_norm.weight"] = (attn.q_norm.weight, 0, c.head_dim)
        table["self_attn.k_norm.weight"] = (attn.k_norm.weight, 0, c.head_dim)
    if attn.qkv_proj.bias is not None:
        table["self_attn.q_proj.bias"] = (attn.qkv_proj.bias, 0, q)
        table["self_attn.k_proj.bias"] = (attn.qkv_proj.bias, q, kv)
        table["self_attn.v_proj.bias"] = (attn.qkv_proj.bias, q + kv, kv)
    return table.get(rest)


def _load_kv_scale(model: CausalLM, name: str, handle: Any) -> bool:
    """A checkpoint's per-tensor fp8 KV scale (``model.layers.N.self_attn.k_scale``/``v_scale``, the
    vLLM / llm-compressor name) onto its attention layer; False for any other tensor."""
    m = _LAYER.match(name)
    if m is None or m.group(2) not in ("self_attn.k_scale", "self_attn.v_scale"):
        return False
    idx = int(m.group(1))
    if idx < model.config.num_layers:
        value = float(handle.get_tensor(name).float().reshape(-1)[0])
        if not value > 0 or value == float("inf"):
            raise ValueError(f"{name} = {value}: a KV scale must be a positive finite number")
        setattr(model.layers[idx].self_attn, m.group(2).removeprefix("self_attn."), value)
    return True


def empty_model(make: Callable[[], M], dtype: torch.dtype, device: str | torch.device) -> M:
    """``make()`` built on ``device`` in ``dtype``, its parameters not yet filled (the loaders fill them)."""
    with torch.device(device):
        model = make()
    model = model.to(dtype)
    model.rotary.float()  # NOTE: the cos/sin table stays fp32 (cast per use) as in HF.
    return model


class WeightFiller:
    """Copies checkpoint tensors into a model's (fused) parameters, counting the rows written, and checks at
    the end that every parameter was written in full. The one copy path of ``load_model`` and of the
    tensor-parallel ``load_shard`` (which reads only its rank's slices of the same tensors)."""

    def __init__(self, model: CausalLM, dtype: torch.dtype) -> None:
        self.model = model
        self.dtype = dtype
        self._written: dict[int, int] = {}  # id(param) -> rows written

    def safetensors(self, files: Iterable[Path]) -> Iterator[tuple[Path, Any, str, Target]]:
        """(file, open handle, tensor name, target) of every tensor of ``files`` that fills a parameter;
        per-tensor fp8 KV scales are set on the way, tensors the model does not use are skipped. The
        handle is open only until the next item.

        Raises:
            ValueError: a file that is not readable safetensors, or a bad KV scale.
        """
        for f in files:
            try:
                handle = safe_open(str(f), framework="pt", device="cpu")
            except (SafetensorError, OSError) as e:
                raise ValueError(f"{f}: cannot read safetensors ({e})") from e
            with handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if _load_kv_scale(self.model, name, handle):
                        continue
                    target = _targets(self.model, name)
                    if target is not None:
                        yield f, handle, name, target

    def copy(self, source: Path, name: str, target: Target, tensor: torch.Tensor) -> None:
        """``tensor`` (``rows`` x the parameter's other dims) into rows ``offset:offset + rows`` of the target.

        Raises:
            ValueError: the tensor's shape is not the target's.
        """
        param, offset, rows = target
        expected = (rows, *param.shape[1:])
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{source}: {name} has shape {tuple(tensor.shape)}, expected {expected}")
        param[offset : offset + rows].copy_(tensor.to(self.dtype))
        self.count(param, rows)

    def count(self, param: torch.Tensor, rows: int) -> None:
        """Count ``rows`` of ``param`` as written (``copy`` does; a caller that fills rows itself, too)."""
        self._written[id(param)] = self._written.get(id(param), 0) + rows

    def check_complete(self, model_dir: Path) -> None:
        """Raises ValueError naming the parameters (first five) the checkpoint did not fill in full."""
        missing = [n for n, p in self.model.named_parameters() if self._written.get(id(p), 0) != p.shape[0]]
        if missing:
            more = "..." if len(missing) > 5 else ""
            raise ValueError(f"{model_dir}: checkpoint lacks weights for {missing[:5]}{more}")


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    max_positions: int | None = None,
) -> CausalLM:
    """Build the model for ``model_dir`` and fill it from its weights.

    ``model_dir`` is an HF directory (config.json + safetensors) or a GGUF checkpoint (a ``.gguf``
    file or a directory holding one, dequantized here to ``dtype``).

    Raises:
        FileNotFoundError: missing config or weights.
        ValueError: unknown architecture, corrupt file, wrong shape, or a parameter never loaded.
    """
    from kvserve.workers.models.gguf_checkpoint import find_gguf, open_gguf

    model_dir = Path(model_dir)
    config = ModelConfig.from_dir(model_dir)
    dtype = dtype or config.dtype
    gguf_path = find_gguf(model_dir)
    files = [gguf_path] if gguf_path is not None else checkpoint_files(model_dir)
    model = empty_model(lambda: CausalLM(config, max_positions or config.max_position_embeddings), dtype, device)
    filler = WeightFiller(model, dtype)
    with torch.no_grad():
        if gguf_path is not None:
            for name, tensor in open_gguf(gguf_path).tensors():
                target = _targets(model, name)
                if target is not None:
                    filler.copy(gguf_path, name, target, tensor)
        else:
            for f, handle, name, target in filler.safetensors(files):
                filler.copy(f, name, target, handle.get_tensor(name))
    filler.check_complete(model_dir)
    logger.info("loaded %s (%s, %d layers) from %s", config.architecture, dtype, config.num_layers, files[0])
    return model.eval()
