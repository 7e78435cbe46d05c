"""Llama-family architecture description read from an HF ``config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# HF architecture name -> (family, q/k/v projections carry a bias)
ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "LlamaForCausalLM": ("llama", False),
    "MistralForCausalLM": ("mistral", False),
    "Qwen2ForCausalLM": ("qwen2", True),
    "Qwen3ForCausalLM": ("qwen3", False),
}
# Families that RMS-normalise each q and k head (over head_dim) before the rotary embedding.
QK_NORM_FAMILIES = frozenset({"qwen3"})
ROPE_TYPES = ("default", "linear", "llama3")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    key = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16", "float": "float32"}.get(
        name, name
    )
    if key not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[key]


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # the HF class name
    family: str  # llama | mistral | qwen2 | qwen3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_type: str
    rope_params: tuple[tuple[str, float], ...]  # extra rope parameters (factor, ...), sorted
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool  # per-head RMSNorm of q and k before rope (Qwen3)
    sliding_window: int | None
    dtype: torch.dtype
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads {self.num_heads} not a multiple of KV heads {self.num_kv_heads}")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope type {self.rope_type!r}; supported: {ROPE_TYPES}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rope(self) -> dict[str, float]:
        return dict(self.rope_params)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        """From an HF directory's ``config.json``, or a GGUF checkpoint's metadata (a ``.gguf`` file or
        a directory holding one).

        Raises:
            FileNotFoundError: neither found.
            ValueError: invalid or unsupported configuration.
        """
        from kvserve.workers.models.gguf_checkpoint import find_gguf, open_gguf

        gguf_path = find_gguf(model_dir)
        if gguf_path is not None:
            return cls.from_dict(open_gguf(gguf_path).hf_config())
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no config.json (expected a HuggingFace model directory or a GGUF file)")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: invalid JSON: {e}") from e
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"unknown architecture {archs!r}; supported: {sorted(ARCHITECTURES)}")
        family, qkv_bias = ARCHITECTURES[arch]
        qkv_bias = bool(raw.get("attention_bias", qkv_bias))
        rope_theta, rope_type, rope_params = _parse_rope(raw)
        window = raw.get("sliding_window")
        if family in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
            window = None
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        heads = int(raw["num_attention_heads"])
        dtype_name = raw.get("torch_dtype") or raw.get("dtype") or "float32"
        return cls(
            architecture=arch,
            family=family,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            rope_theta=rope_theta,
            rope_type=rope_type,
            rope_params=rope_params,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=family in QK_NORM_FAMILIES,
            sliding_window=int(window) if window else None,
            dtype=parse_dtype(dtype_name),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _parse_rope(raw: dict[str, Any]) -> tuple[float, str, tuple[tuple[str, float], ...]]:
    """Both forms found in the wild: classic ``rope_theta``/``rope_scaling`` and transformers 5's
    ``rope_parameters`` (which holds the theta too)."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    extra = tuple(
        sorted(
            (k, float(v))
            for k, v in params.items()
            if k not in ("rope_type", "type", "rope_theta") and isinstance(v, int | float)
        )
    )
    return theta, rope_type, extra
