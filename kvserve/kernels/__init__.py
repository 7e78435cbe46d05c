"""Backend selection: Triton kernels on CUDA, the C++ CPU kernels (with the torch reference where
they do not apply or are not built) on CPU.

``KVSERVE_ATTENTION_BACKEND=triton|cpu|torch`` overrides the choice (``torch``: the plain-torch
reference only); Triton on a CPU tensor needs ``TRITON_INTERPRET=1`` (slow; for tests). Workers run
kernels through ``get_backend()`` (the model's attention and the KV cache's stores and copies);
``kvserve/workers/engine/kv_cache.py`` also calls ``reference`` directly for host swap copies and raw-byte views,
which need no kernel.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

BACKENDS = ("triton", "cpu", "torch")


def triton_interpreting() -> bool:
    """Whether ``TRITON_INTERPRET`` is on (Triton kernels then run on CPU tensors, slowly)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def backend_name(device: torch.device | str | None = None) -> str:
    """The backend the engine uses on ``device``: the env override, else triton on CUDA, cpu elsewhere."""
    forced = os.environ.get("KVSERVE_ATTENTION_BACKEND", "").strip().lower()
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"KVSERVE_ATTENTION_BACKEND={forced!r}: expected one of {BACKENDS}")
        return forced
    if device is None:
        return "cpu"
    # NOTE: a torch.device is used as is: the model asks once per norm, activation and attention call.
    dev = device if isinstance(device, torch.device) else torch.device(device)
    return "triton" if dev.type == "cuda" else "cpu"


def get_backend(device: torch.device | str | None = None) -> ModuleType:
    """A module exposing store_kv, rope_store_kv, decode_attention, prefill_attention, copy_blocks, swap_blocks,
    rms_norm, fused_add_rms_norm and silu_and_mul."""
    name = backend_name(device)
    module = _LOADED.get(name)
    if module is None:  # imported on first use: the triton backend imports triton
        module = _LOADED[name] = importlib.import_module(_MODULES[name])
    return module


_MODULES = {"triton": "kvserve.kernels.triton_backend", "cpu": "kvserve.kernels.cpu_backend",
            "torch": "kvserve.kernels.reference"}  # fmt: skip
_LOADED: dict[str, ModuleType] = {}
