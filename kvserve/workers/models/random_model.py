"""Write a randomly initialised HF-format Llama/Qwen2/Qwen3 checkpoint (no transformers needed).

For tests, demos and benchmarks without downloading weights: ``config.json``, safetensors
weights (optionally sharded with the standard ``model.safetensors.index.json``), a byte-level
BPE ``tokenizer.json`` covering exactly the model's 32000 ids, ``tokenizer_config.json`` and
``generation_config.json``. Output is a pure function of (arch, size, seed, dtype): same
arguments, same bytes.

CLI: ``kvserve model init-random --arch llama --size tiny [--seed 0] [--dtype float32]
[--max-shard-size BYTES] OUT_DIR`` (wired by ``kvserve/cluster/cli.py`` through
``add_init_random_arguments`` / ``run_init_random``).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors

VOCAB_SIZE = 32000
UNK_TOKEN, BOS_TOKEN, EOS_TOKEN = "<unk>", "<s>", "</s>"
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
# ChatML turn markers: the vocabulary's last two ids (special tokens, so text never merges into them).
IM_START_TOKEN, IM_END_TOKEN = "<|im_start|>", "<|im_end|>"
IM_START_ID, IM_END_ID = VOCAB_SIZE - 2, VOCAB_SIZE - 1
# A small ChatML template (as Qwen2/SmolLM2 use), BOS first as Llama-style templates write it.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
MAX_POSITION_EMBEDDINGS = 4096
INIT_STD = 0.02

ARCHS = ("llama", "qwen2", "qwen3")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelSize:
    """Shape of a random model (head_dim = hidden_size // num_attention_heads)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int


SIZES = {
    "tiny": ModelSize(256, 688, 4, 8, 2),
    "small": ModelSize(768, 2048, 12, 12, 4),
}

_ARCH_NAMES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# NOTE: Qwen3 decouples head_dim from hidden_size / heads (Qwen3-0.6B: 1024 / 16 heads, head_dim 128);
# its random checkpoints use twice the derived head_dim so a coupling bug cannot pass the parity test.
_HEAD_DIM_FACTOR = {"qwen3": 2}


def init_random(
    out_dir: str | Path,
    arch: str = "llama",
    size: str = "tiny",
    seed: int = 0,
    dtype: str = "float32",
    max_shard_bytes: int | None = None,
) -> int:
    """Write a random checkpoint into ``out_dir`` (created if needed; existing files overwritten).

    Args:
        out_dir: Target directory.
        arch: "llama", "qwen2" (adds q/k/v projection biases) or "qwen3" (per-head q/k RMSNorm,
            head_dim twice hidden_size / heads).
        size: "tiny" or "small" (see ``SIZES``).
        seed: Seeds the weight generator; same seed, same bytes.
        dtype: "float32", "bfloat16" or "float16" (weights are drawn in float32, then cast).
        max_shard_bytes: When given, split weights into ``model-0000i-of-0000N.safetensors``
            files of at most this many bytes each (a bigger single tensor gets a shard of its own)
            plus ``model.safetensors.index.json``; a single resulting shard is written as
            ``model.safetensors`` with no index, as HF does.

    Returns:
        The number of parameters written.

    Raises:
        ValueError: on an unknown arch/size/dtype or a non-positive max_shard_bytes.
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {tuple(SIZES)}, got {size!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shape = SIZES[size]
    tensors = random_weights(arch, shape, seed, DTYPES[dtype])
    _write_json(out / "config.json", model_config(arch, shape, dtype))
    _write_weights(out, tensors, max_shard_bytes)
    write_tokenizer(out)
    # NOTE: its chat template ends a turn with <|im_end|>, so that ends generation too (as in a chat
    # model's generation_config, and as a GGUF of it says: llama.cpp counts <|im_end|> as end of generation).
    _write_json(out / "generation_config.json", {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, IM_END_ID]})
    return sum(t.numel() for t in tensors.values())


def model_config(arch: str, shape: ModelSize, dtype: str) -> dict:
    """The ``config.json`` contents for ``arch`` with ``shape``."""
    config = {
        "architectures": [_ARCH_NAMES[arch]],
        "model_type": arch,
        "vocab_size": VOCAB_SIZE,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": head_dim(arch, shape),
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
    }
    if arch == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    elif arch == "qwen3":
        config.update(
            attention_bias=False, use_sliding_window=False, sliding_window=None,
            max_window_layers=shape.num_hidden_layers,
        )  # fmt: skip
    else:
        # Qwen2 always has q/k/v biases (no config switch); sliding window stays off so every
        # layer is full attention.
        config.update(
            use_sliding_window=False, sliding_window=None, max_window_layers=shape.num_hidden_layers
        )
    return config


def head_dim(arch: str, shape: ModelSize) -> int:
    """The checkpoint's head_dim: hidden_size / heads, times ``_HEAD_DIM_FACTOR`` for Qwen3."""
    return shape.hidden_size // shape.num_attention_heads * _HEAD_DIM_FACTOR.get(arch, 1)


def random_weights(arch: str, shape: ModelSize, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """HF-named weights: linear/embedding ~ N(0, 0.02), biases ~ N(0, 0.02), RMSNorm weights = 1.

    Tensors are drawn in a fixed order from one generator seeded with ``seed``, so the result is
    deterministic. Linear weights are ``[out_features, in_features]`` as in ``nn.Linear``.
    """
    g = torch.Generator().manual_seed(seed)

    def normal(*dims: int) -> torch.Tensor:
        return torch.empty(*dims).normal_(0.0, INIT_STD, generator=g).to(dtype)

    h, inter = shape.hidden_size, shape.intermediate_size
    hd = head_dim(arch, shape)
    q_dim, kv_dim = shape.num_attention_heads * hd, shape.num_key_value_heads * hd

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(VOCAB_SIZE, h)}
    for i in range(shape.num_hidden_layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = normal(q_dim, h)
        w[p + "self_attn.k_proj.weight"] = normal(kv_dim, h)
        w[p + "self_attn.v_proj.weight"] = normal(kv_dim, h)
        if arch == "qwen2":
            w[p + "self_attn.q_proj.bias"] = normal(q_dim)
            w[p + "self_attn.k_proj.bias"] = normal(kv_dim)
            w[p + "self_attn.v_proj.bias"] = normal(kv_dim)
        if arch == "qwen3":
            # Norm weights around 1 but not 1: a q/k norm the engine skipped would show.
            w[p + "self_attn.q_norm.weight"] = 1 + 10 * normal(hd)
            w[p + "self_attn.k_norm.weight"] = 1 + 10 * normal(hd)
        w[p + "self_attn.o_proj.weight"] = normal(h, q_dim)
        w[p + "mlp.gate_proj.weight"] = normal(inter, h)
        w[p + "mlp.up_proj.weight"] = normal(inter, h)
        w[p + "mlp.down_proj.weight"] = normal(h, inter)
        w[p + "input_layernorm.weight"] = torch.ones(h, dtype=dtype)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=dtype)
    w["model.norm.weight"] = torch.ones(h, dtype=dtype)
    w["lm_head.weight"] = normal(VOCAB_SIZE, h)
    return w


def _write_weights(out: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int | None) -> None:
    # Remove weights from an earlier run so a loader never mixes old shards with new ones.
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    metadata = {"format": "pt"}  # transformers refuses safetensors files without it
    shards = _plan_shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file(tensors, str(out / "model.safetensors"), metadata=metadata)
        return
    weight_map: dict[str, str] = {}
    for i, names in enumerate(shards, start=1):
        filename = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, str(out / filename), metadata=metadata)
        weight_map.update(dict.fromkeys(names, filename))
    total = sum(_nbytes(t) for t in tensors.values())
    _write_json(
        out / "model.safetensors.index.json",
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
    )


def _plan_shards(tensors: dict[str, torch.Tensor], max_shard_bytes: int | None) -> list[list[str]]:
    """Greedy, in insertion order: start a new shard when the next tensor would overflow it."""
    if max_shard_bytes is None:
        return [list(tensors)]
    shards: list[list[str]] = [[]]
    used = 0
    for name, t in tensors.items():
        if shards[-1] and used + _nbytes(t) > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += _nbytes(t)
    return shards


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# --- tokenizer -----------------------------------------------------------------------------

# Printable ASCII, most frequent English characters first, so early merges are the useful ones.
_CHAR_ORDER = (
    " etaoinsrhldcumfpgwybvkxjqzETAOINSRHLDCUMFPGWYBVKXJQZ0123456789.,'\"-!?:;()[]{}<>/\\|@#$%^&*_+=~`"
)
# A triple merge is added only when its characters' ranks sum to at most this: bounds the search
# while leaving far more candidates (~40k) than the ~22.7k the vocabulary needs.
_MAX_TRIPLE_RANK_SUM = 60

_TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": BOS_TOKEN,
    "eos_token": EOS_TOKEN,
    "unk_token": UNK_TOKEN,
    "add_bos_token": True,
    "add_eos_token": False,
    "clean_up_tokenization_spaces": False,
    "model_max_length": MAX_POSITION_EMBEDDINGS,
    "chat_template": CHAT_TEMPLATE,
}


def write_tokenizer(out_dir: str | Path) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (the tokenizer alone, for tests)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", _TOKENIZER_CONFIG)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable char table used by the ByteLevel pre-tokenizer and decoder."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_tokenizer(vocab_size: int = VOCAB_SIZE) -> HFTokenizer:
    """A byte-level BPE tokenizer with exactly ``vocab_size`` ids, all decodable.

    Ids: 0 ``<unk>``, 1 ``<s>``, 2 ``</s>``, 3..258 the 256 bytes (in byte order), then merged
    tokens: every pair of printable ASCII chars, then triples (pair + char), most frequent
    characters first, until the vocabulary is full but for its last two ids, the ChatML specials
    ``<|im_start|>`` and ``<|im_end|>``. Encoding adds ``<s>`` (template post-processor,
    matching ``add_bos_token`` in tokenizer_config.json).
    """
    byte_chars = bytes_to_unicode()
    chars = [byte_chars[ord(c)] for c in _CHAR_ORDER]  # in ByteLevel form (space -> "Ġ")
    vocab: dict[str, int] = {UNK_TOKEN: UNK_ID, BOS_TOKEN: BOS_ID, EOS_TOKEN: EOS_ID}
    for b in range(256):
        vocab[byte_chars[b]] = len(vocab)
    merges: list[tuple[str, str]] = []
    for left, right in _merge_candidates(chars):
        if len(vocab) >= vocab_size - 2:
            break
        token = left + right
        if token not in vocab:
            vocab[token] = len(vocab)
            merges.append((left, right))
    vocab[IM_START_TOKEN], vocab[IM_END_TOKEN] = len(vocab), len(vocab) + 1
    if len(vocab) != vocab_size:
        raise ValueError(f"could not fill a vocabulary of {vocab_size} (got {len(vocab)})")

    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, BOS_ID)]
    )
    # Already in the vocabulary: ids unchanged.
    tok.add_special_tokens([UNK_TOKEN, BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN])
    return tok


def _merge_candidates(chars: list[str]):
    """Merge pairs in rank order: char pairs by rank sum, then (pair, char) triples by rank sum."""
    n = len(chars)
    pairs = sorted(((i, j) for i in range(n) for j in range(n)), key=lambda p: (p[0] + p[1], p))
    for i, j in pairs:
        yield chars[i], chars[j]
    bound = _MAX_TRIPLE_RANK_SUM
    triples = [
        (i, j, k)
        for i in range(min(n, bound + 1))
        for j in range(min(n, bound - i + 1))
        for k in range(min(n, bound - i - j + 1))
    ]
    triples.sort(key=lambda t: (sum(t), t))
    for i, j, k in triples:
        yield chars[i] + chars[j], chars[k]


# --- CLI -----------------------------------------------------------------------------------


def add_init_random_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``kvserve model init-random`` arguments to ``parser``."""
    parser.add_argument("out_dir", metavar="OUT_DIR", help="directory to write the checkpoint into")
    parser.add_argument("--arch", choices=ARCHS, default="llama", help="model family (default: llama)")
    parser.add_argument("--size", choices=tuple(SIZES), default="tiny", help="model size (default: tiny)")
    parser.add_argument("--seed", type=int, default=0, help="weight RNG seed (default: 0)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="weight dtype")
    parser.add_argument(
        "--max-shard-size",
        type=parse_size,
        default=None,
        metavar="BYTES",
        help="shard weights into files of at most this size (e.g. 50000000, 50MB, 2GiB)",
    )


def run_init_random(args: argparse.Namespace) -> int:
    """Run ``kvserve model init-random`` from parsed ``args``; prints a summary to stderr.

    Returns:
        The process exit code (0).
    """
    num_params = init_random(
        args.out_dir,
        arch=args.arch,
        size=args.size,
        seed=args.seed,
        dtype=args.dtype,
        max_shard_bytes=args.max_shard_size,
    )
    print(
        f"wrote random {args.arch}-{args.size} ({num_params / 1e6:.1f}M params, {args.dtype}, "
        f"seed {args.seed}) to {Path(args.out_dir).resolve()}",
        file=sys.stderr,
    )
    return 0


_SIZE_SUFFIXES = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
}


def parse_size(text: str) -> int:
    """Parse a byte count such as ``50000000``, ``50MB`` or ``2GiB`` (argparse ``type=``).

    Raises:
        argparse.ArgumentTypeError: on anything else or a non-positive size.
    """
    s = text.strip().upper()
    number = s.rstrip("KMGIB")
    suffix = s[len(number) :]
    if suffix not in _SIZE_SUFFIXES or not number.isdigit() or int(number) <= 0:
        raise argparse.ArgumentTypeError(f"invalid size {text!r} (expected e.g. 50000000, 50MB, 2GiB)")
    return int(number) * _SIZE_SUFFIXES[suffix]


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n", encoding="utf-8")
