"""Read a GGUF checkpoint (llama.cpp's format) as what an HF directory would hold.

One reader serves two users: ``kvserve model fetch`` writes the result out as an HF directory
(``kvserve/cluster/model_fetch.py``) and the loader serves a ``.gguf`` directly (``kvserve/workers/models/loader.py``).
Both see the same three things:

* ``hf_config()``: a ``config.json`` dict built from the GGUF metadata (architecture, shapes, rope);
* ``tensors()``: every weight under its HF name, dequantized to fp32 through the ``gguf`` package
  (any type it implements: Q4_0/Q4_1/Q8_0/K-quants/F16/F32/BF16...);
* ``tokenizer()``: a ``tokenizers`` byte-level BPE rebuilt from the GGUF vocabulary, merges and
  special tokens, plus the ``tokenizer_config.json`` / ``generation_config.json`` dicts.

NOTE: llama.cpp's converter permutes the rows of Llama q/k projections (its rotary pairs adjacent
dims, HF's pairs the two halves); ``tensors()`` undoes that so HF's formula applies again.
"""


from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from kvserve.workers.text.gguf_metadata import GGUF_SUFFIX, GGUFMetadata, GGUFTokenizer, find_gguf

__all__ = ["GGUF_SUFFIX", "GGUFCheckpoint", "GGUFTokenizer", "find_gguf", "open_gguf", "unpermute_rotary_rows"]


class GGUFCheckpoint(GGUFMetadata):
    """An opened GGUF file: its metadata (``GGUFMetadata``) and its weights, dequantized one at a time."""

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight as (HF name, fp32 tensor in HF layout), one dequantized at a time.

        Raises:
            ValueError: a tensor this module does not know (the checkpoint would load incompletely).
            NotImplementedError: a quantization type the ``gguf`` package cannot dequantize.
        """
        from gguf.quants import dequantize

        heads = int(self._arch_field("attention.head_count"))
        kv_heads = int(self._arch_field("attention.head_count_kv", heads))
        for name, t in self._tensors.items():
            hf_name = self._hf_name(name)
            if hf_name is None:
                raise ValueError(f"{self.path}: unknown GGUF tensor {name!r}")
            # GGUF shapes are innermost-first; dequantize returns numpy in row-major [rows, cols].
            array = dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(d) for d in t.shape])))
            tensor = torch.from_numpy(np.array(array, dtype=np.float32, order="C"))  # a copy: the map is read-only
            if self.arch.permuted_qk:
                if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
                    tensor = unpermute_rotary_rows(tensor, heads)
                elif hf_name.endswith(("k_proj.weight", "k_proj.bias")):
                    tensor = unpermute_rotary_rows(tensor, kv_heads)
            yield hf_name, tensor

@functools.lru_cache(maxsize=4)
def _open_cached(path: str, mtime_ns: int) -> GGUFCheckpoint:
    return GGUFCheckpoint(path)


def open_gguf(path: str | Path) -> GGUFCheckpoint:
    """A ``GGUFCheckpoint`` for ``path``, shared between the config, weight and tokenizer loaders of
    one process (parsing the metadata of a large vocabulary is not free); a rewritten file reopens."""
    path = Path(path).resolve()
    return _open_cached(str(path), path.stat().st_mtime_ns)


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (``convert_hf_to_gguf.py``'s ``permute``): per head, its
    rows went from [first half; second half] to interleaved pairs; this puts them back."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    if head_dim * num_heads != rows or head_dim % 2:
        raise ValueError(f"cannot un-permute {rows} rows over {num_heads} heads")
    return weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
