"""A GGUF checkpoint's metadata (llama.cpp's format) as what an HF directory would hold, without torch.

``GGUFMetadata`` reads what the router and the text tools need of a ``.gguf`` (``hf_config()``: a
``config.json`` dict; ``tokenizer()``: a ``tokenizers`` byte-level BPE rebuilt from the vocabulary, merges
and special tokens, with its ``tokenizer_config.json``/``generation_config.json`` dicts), so a router serving
a GGUF model never loads torch. The weights are kvserve/workers/models/gguf_checkpoint.py's
(``GGUFCheckpoint`` adds ``tensors()`` to this class).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

GGUF_SUFFIX = ".gguf"


@dataclass(frozen=True)
class _Arch:
    hf_name: str  # config.json "architectures" entry
    model_type: str
    permuted_qk: bool  # llama.cpp permuted q/k rows for its rotary layout
    qkv_bias: bool


# GGUF general.architecture -> how it maps onto HF. Mistral GGUFs are written as "llama".
_ARCHS: dict[str, _Arch] = {
    "llama": _Arch("LlamaForCausalLM", "llama", permuted_qk=True, qkv_bias=False),
    "qwen2": _Arch("Qwen2ForCausalLM", "qwen2", permuted_qk=False, qkv_bias=True),
    "qwen3": _Arch("Qwen3ForCausalLM", "qwen3", permuted_qk=False, qkv_bias=False),
}

# GGUF tensor name (within a block) -> HF name (within model.layers.N)
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")

# GGUF token types (llama.cpp's llama_token_type)
_CONTROL, _USER_DEFINED = 3, 4

# End-of-generation tokens llama.cpp recognises by text (llama-vocab.cpp), beside the metadata's eos id.
_END_TOKEN_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>",
    "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
})  # fmt: skip

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level_after(split: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])  # fmt: skip


# GGUF tokenizer.ggml.pre -> the pre-tokenizer HF's tokenizer.json uses for that family
# (llama.cpp's llm_tokenizer_bpe regexes, same names).
_PRE_TOKENIZERS = {
    "default": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False),
    "gpt-2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False),
    "smollm": _digits_then_gpt2,
    "starcoder": _digits_then_gpt2,
    "refact": _digits_then_gpt2,
    "llama-bpe": lambda: _byte_level_after(_LLAMA3_SPLIT),
    "qwen2": lambda: _byte_level_after(_QWEN2_SPLIT),
}
_NFC_PRE = frozenset({"qwen2"})  # Qwen's tokenizer.json normalizes to NFC first


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file ``path`` names: ``path`` itself when it is a ``.gguf`` file, the single ``.gguf``
    of a directory without ``config.json``, else None (an HF directory, or nothing).

    Raises:
        ValueError: a directory (without config.json) holding several ``.gguf`` files.
    """
    path = Path(path)
    if path.is_file() and path.suffix == GGUF_SUFFIX:
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(path.glob(f"*{GGUF_SUFFIX}"))
    if len(found) > 1:
        raise ValueError(f"{path}: several GGUF files ({', '.join(f.name for f in found)}); name one")
    return found[0] if found else None


@dataclass(frozen=True)
class GGUFTokenizer:
    """What a GGUF says about its tokenizer, as HF files hold it."""

    tokenizer: Tokenizer  # the tokenizer.json contents
    tokenizer_config: dict[str, Any]  # tokenizer_config.json
    generation_config: dict[str, Any]  # generation_config.json


class GGUFMetadata:
    """An opened GGUF file's metadata (memory-mapped; nothing is dequantized)."""

    def __init__(self, path: str | Path) -> None:
        """
        Raises:
            FileNotFoundError: no such file.
            ValueError: not a readable GGUF, or an architecture we do not serve.
        """
        import gguf  # NOTE: imported here: only GGUF users pay for it

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no such GGUF file")
        try:
            self._reader = gguf.GGUFReader(str(self.path))
        except (ValueError, OSError, AssertionError) as e:
            raise ValueError(f"{self.path}: not a readable GGUF file ({e})") from e
        self.arch_name = str(self._field("general.architecture"))
        if self.arch_name not in _ARCHS:
            raise ValueError(
                f"{self.path}: GGUF architecture {self.arch_name!r} unsupported; supported: {sorted(_ARCHS)}"
            )
        self.arch = _ARCHS[self.arch_name]
        self._tensors = {t.name: t for t in self._reader.tensors}
        if "rope_freqs.weight" in self._tensors:
            raise ValueError(f"{self.path}: GGUF per-dimension rope frequencies (Llama 3.1 scaling) are unsupported")

    @property
    def num_tensors(self) -> int:
        return len(self._tensors)

    def _field(self, key: str, default: Any = None) -> Any:
        field = self._reader.fields.get(key)
        return default if field is None else field.contents()

    def _arch_field(self, key: str, default: Any = None) -> Any:
        return self._field(f"{self.arch_name}.{key}", default)

    # ---- config.json

    def hf_config(self, dtype: str = "float32") -> dict[str, Any]:
        """The ``config.json`` of this checkpoint, with ``torch_dtype`` ``dtype``.

        Raises:
            ValueError: metadata missing a required key.
        """
        required = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")
        missing = [k for k in required if self._arch_field(k) is None]
        if missing:
            raise ValueError(f"{self.path}: GGUF metadata lacks {[f'{self.arch_name}.{k}' for k in missing]}")
        hidden = int(self._arch_field("embedding_length"))
        heads = int(self._arch_field("attention.head_count"))
        kv_heads = int(self._arch_field("attention.head_count_kv", heads))
        rope_dim = self._arch_field("rope.dimension_count", hidden // heads)
        head_dim = int(self._arch_field("attention.key_length", rope_dim))
        tokens = self._field("tokenizer.ggml.tokens") or []
        embed_rows = int(self._tensors["token_embd.weight"].shape[1])
        config: dict[str, Any] = {
            "architectures": [self.arch.hf_name],
            "model_type": self.arch.model_type,
            "vocab_size": int(self._arch_field("vocab_size", len(tokens) or embed_rows)),
            "hidden_size": hidden,
            "intermediate_size": int(self._arch_field("feed_forward_length")),
            "num_hidden_layers": int(self._arch_field("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "rms_norm_eps": _shortest(self._arch_field("attention.layer_norm_rms_epsilon", 1e-6)),
            "max_position_embeddings": int(self._arch_field("context_length", 4096)),
            "rope_theta": _shortest(self._arch_field("rope.freq_base", 10000.0)),
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "attention_bias": "blk.0.attn_q.bias" in self._tensors,
            "hidden_act": "silu",
            "torch_dtype": dtype,
        }
        scaling = self._arch_field("rope.scaling.type")
        if scaling not in (None, "none"):
            if scaling != "linear":
                raise ValueError(f"{self.path}: GGUF rope scaling {scaling!r} unsupported (only linear)")
            config["rope_scaling"] = {"rope_type": "linear", "factor": float(self._arch_field("rope.scaling.factor"))}
        for key in ("bos_token_id", "eos_token_id"):
            value = self._field(f"tokenizer.ggml.{key}")
            if value is not None:
                config[key] = int(value)
        return config

    # ---- weights

    # ---- weights' names

    @staticmethod
    def _hf_name(name: str) -> str | None:
        if name in _GLOBAL_TENSORS:
            return _GLOBAL_TENSORS[name]
        m = _BLOCK.match(name)
        if m is None or m.group(2) not in _LAYER_TENSORS:
            return None
        return f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}"

    # ---- tokenizer

    def tokenizer(self) -> GGUFTokenizer:
        """The tokenizer rebuilt as a byte-level BPE, with its HF config files.

        Raises:
            ValueError: a tokenizer model or pre-tokenizer this module cannot rebuild exactly.
        """
        kind = self._field("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"{self.path}: GGUF tokenizer model {kind!r} unsupported (only byte-level BPE, 'gpt2')")
        pre = self._field("tokenizer.ggml.pre", "default")
        if pre not in _PRE_TOKENIZERS:
            raise ValueError(
                f"{self.path}: GGUF pre-tokenizer {pre!r} unsupported; supported: {sorted(_PRE_TOKENIZERS)}"
            )
        tokens: list[str] = list(self._field("tokenizer.ggml.tokens"))
        types: list[int] = list(self._field("tokenizer.ggml.token_type") or [1] * len(tokens))
        merges = [tuple(m.split(" ", 1)) for m in self._field("tokenizer.ggml.merges") or []]
        vocab = {tok: i for i, tok in enumerate(tokens)}
        tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
        if pre in _NFC_PRE:
            tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = _PRE_TOKENIZERS[pre]()
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        tok.add_special_tokens([tokens[i] for i, kind in enumerate(types) if kind == _CONTROL])
        tok.add_tokens([tokens[i] for i, kind in enumerate(types) if kind == _USER_DEFINED])

        def text(key: str) -> str | None:
            idx = self._field(f"tokenizer.ggml.{key}")
            return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else None

        bos_id, eos_id = self._field("tokenizer.ggml.bos_token_id"), self._field("tokenizer.ggml.eos_token_id")
        tok_config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": bool(self._field("tokenizer.ggml.add_bos_token", False)),
            "add_eos_token": bool(self._field("tokenizer.ggml.add_eos_token", False)),
            "clean_up_tokenization_spaces": False,
            "model_max_length": int(self._arch_field("context_length", 4096)),
        }
        for key in ("bos", "eos", "unknown", "padding"):
            value = text(f"{key}_token_id")
            if value is not None:
                tok_config[{"unknown": "unk_token", "padding": "pad_token"}.get(key, f"{key}_token")] = value
        template = self._field("tokenizer.chat_template")
        if template:
            tok_config["chat_template"] = str(template)
        gen_config: dict[str, Any] = {}
        if bos_id is not None:
            gen_config["bos_token_id"] = int(bos_id)
        end_ids = self.end_token_ids(tokens, types)
        if end_ids:
            gen_config["eos_token_id"] = end_ids if len(end_ids) > 1 else end_ids[0]
        pad_id = self._field("tokenizer.ggml.padding_token_id")
        if pad_id is not None:
            gen_config["pad_token_id"] = int(pad_id)
        del eos_id  # the primary eos leads end_token_ids
        return GGUFTokenizer(tok, tok_config, gen_config)

    def end_token_ids(self, tokens: list[str], types: list[int]) -> list[int]:
        """The ids that end generation: the metadata's eos (first), eot and eom ids, then every control
        token whose text llama.cpp treats as an end of generation (``<|im_end|>``, ``<|endoftext|>``...)."""
        ids: list[int] = []
        for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
            value = self._field(f"tokenizer.ggml.{key}")
            if value is not None and int(value) not in ids:
                ids.append(int(value))
        for i, (token, kind) in enumerate(zip(tokens, types, strict=True)):
            if kind in (_CONTROL, _USER_DEFINED) and token in _END_TOKEN_TEXTS and i not in ids:
                ids.append(i)
        return ids


def _shortest(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


@functools.lru_cache(maxsize=4)
def _open_cached(path: str, mtime_ns: int) -> GGUFMetadata:
    return GGUFMetadata(path)


def open_gguf_metadata(path: str | Path) -> GGUFMetadata:
    """A ``GGUFMetadata`` for ``path``, shared by the config and tokenizer loaders of one process (parsing the
    metadata of a large vocabulary is not free); a rewritten file reopens."""
    path = Path(path).resolve()
    return _open_cached(str(path), path.stat().st_mtime_ns)
