"""Loading HF checkpoints: shards, config forms (rope), broken files, tied embeddings."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve.workers.core.sampling_params import SamplingParams
from kvserve.workers.engine.engine import LLM
from kvserve.workers.models.loader import checkpoint_files, load_model
from kvserve.workers.models.model import rope_inv_freq
from kvserve.workers.models.model_config import ModelConfig
from kvserve.workers.models.random_model import init_random

N = 16
GREEDY = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 900, 31000, 42, 7, 7, 7, 1234, 19], [3]]


def _greedy(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(str(model_dir), device="cpu", block_size=16, num_gpu_blocks=32)
    outs = llm.generate(prompts, GREEDY, check_integrity=True)
    assert llm.engine.pool.stats().used == 0
    return [o.token_ids for o in outs]


def _copy_without(src: Path, dst: Path, *skip: str) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name not in skip:
            (dst / f.name).symlink_to(f)
    return dst


# ---- sharding ----------------------------------------------------------------------------------


def test_sharded_checkpoint_loads_identically(tiny_llama_dir: Path, tmp_path: Path) -> None:
    sharded = tmp_path / "sharded"
    init_random(sharded, arch="llama", size="tiny", seed=0, max_shard_bytes=2_000_000)
    files = checkpoint_files(sharded)
    assert len(files) > 2 and all(re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", f.name) for f in files)
    assert checkpoint_files(tiny_llama_dir) == [tiny_llama_dir / "model.safetensors"]

    single, shards = load_model(tiny_llama_dir), load_model(sharded)
    a, b = single.state_dict(), shards.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert _greedy(sharded, PROMPTS) == _greedy(tiny_llama_dir, PROMPTS)


def test_missing_shard_named_in_index(tmp_path: Path) -> None:
    d = tmp_path / "m"
    init_random(d, arch="llama", size="tiny", seed=0, max_shard_bytes=40_000_000)
    shard = sorted(d.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        load_model(d)


# ---- config forms ------------------------------------------------------------------------------

_BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 1000,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
}
_LLAMA3 = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 2048,
}


def test_classic_and_rope_parameters_forms_parse_the_same() -> None:
    classic = ModelConfig.from_dict({**_BASE, "rope_theta": 500000.0})
    v5 = ModelConfig.from_dict({**_BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}})
    assert classic == v5
    assert (classic.rope_theta, classic.rope_type, classic.rope_params) == (500000.0, "default", ())

    scaled_classic = ModelConfig.from_dict(
        {**_BASE, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **_LLAMA3}}
    )
    scaled_v5 = ModelConfig.from_dict(
        {**_BASE, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **_LLAMA3}}
    )
    # Older checkpoints spell the key "type".
    scaled_old = ModelConfig.from_dict({**_BASE, "rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **_LLAMA3}})
    assert scaled_classic == scaled_v5 == scaled_old
    assert scaled_v5.rope_type == "llama3" and scaled_v5.rope == _LLAMA3
    assert scaled_v5.rope_theta == 500000.0


def test_default_rope_theta() -> None:
    assert ModelConfig.from_dict(_BASE).rope_theta == 10000.0


@pytest.mark.parametrize(
    "raw",
    [
        {**_BASE, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **_LLAMA3}},
        {**_BASE, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **_LLAMA3}},
        {**_BASE, "rope_theta": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
        {**_BASE, "rope_theta": 1e6},
    ],
    ids=["llama3-classic", "llama3-rope_parameters", "linear", "default"],
)
def test_rope_inv_freq_matches_hf(raw: dict) -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf = LlamaRotaryEmbedding(transformers.LlamaConfig(**raw)).inv_freq
    config = ModelConfig.from_dict(raw)
    ours = rope_inv_freq(config)
    assert ours.shape == hf.shape == (16,)
    torch.testing.assert_close(ours, hf, rtol=1e-6, atol=0)
    if config.rope_type != "default":
        plain = rope_inv_freq(ModelConfig.from_dict({**_BASE, "rope_theta": config.rope_theta}))
        assert not torch.equal(ours, plain)  # the scaling did something


def test_unknown_rope_type_raises() -> None:
    with pytest.raises(ValueError, match="rope"):
        ModelConfig.from_dict({**_BASE, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


# ---- broken inputs -----------------------------------------------------------------------------


def test_missing_safetensors(tiny_llama_dir: Path, tmp_path: Path) -> None:
    d = _copy_without(tiny_llama_dir, tmp_path / "m", "model.safetensors")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(d)
    with pytest.raises(FileNotFoundError):
        LLM(str(d), device="cpu", num_gpu_blocks=8)


def test_missing_config(tiny_llama_dir: Path, tmp_path: Path) -> None:
    d = _copy_without(tiny_llama_dir, tmp_path / "m", "config.json")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(d)


@pytest.mark.parametrize("keep", [0.5, 0.999, 100, 5])
def test_truncated_safetensors(tiny_llama_dir: Path, tmp_path: Path, keep: float) -> None:
    d = _copy_without(tiny_llama_dir, tmp_path / "m", "model.safetensors")
    data = (tiny_llama_dir / "model.safetensors").read_bytes()
    cut = int(len(data) * keep) if keep < 1 else int(keep)
    (d / "model.safetensors").write_bytes(data[:cut])
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(d)


def test_corrupt_index(tiny_llama_dir: Path, tmp_path: Path) -> None:
    d = _copy_without(tiny_llama_dir, tmp_path / "m")
    (d / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ValueError, match="index"):
        load_model(d)


def test_wrong_shape_and_missing_tensor(tiny_llama_dir: Path, tmp_path: Path) -> None:
    weights = load_file(str(tiny_llama_dir / "model.safetensors"))
    d = _copy_without(tiny_llama_dir, tmp_path / "shape", "model.safetensors")
    bad = dict(weights)
    bad["model.norm.weight"] = torch.ones(255)
    save_file(bad, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.norm.weight"):
        load_model(d)
    d = _copy_without(tiny_llama_dir, tmp_path / "missing", "model.safetensors")
    short = {k: v for k, v in weights.items() if k != "model.layers.1.self_attn.k_proj.weight"}
    save_file(short, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks weights"):
        load_model(d)


@pytest.mark.parametrize("archs", [["GPT2LMHeadModel"], [], None])
def test_unknown_architecture(tiny_llama_dir: Path, tmp_path: Path, archs: list[str] | None) -> None:
    d = _copy_without(tiny_llama_dir, tmp_path / "m", "config.json")
    raw = json.loads((tiny_llama_dir / "config.json").read_text())
    if archs is None:
        del raw["architectures"]
    else:
        raw["architectures"] = archs
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="architecture"):
        load_model(d)
    with pytest.raises(ValueError, match="architecture"):
        LLM(str(d), device="cpu", num_gpu_blocks=8)


# ---- tied embeddings ---------------------------------------------------------------------------


def test_tied_embeddings_match_hf(tiny_llama_dir: Path, tmp_path: Path, hf_greedy) -> None:
    d = tmp_path / "tied"
    shutil.copytree(tiny_llama_dir, d)
    raw = json.loads((d / "config.json").read_text())
    raw["tie_word_embeddings"] = True
    (d / "config.json").write_text(json.dumps(raw))
    weights = load_file(str(d / "model.safetensors"))
    del weights["lm_head.weight"]
    save_file(weights, str(d / "model.safetensors"), metadata={"format": "pt"})

    model = load_model(d)
    assert model.lm_head is None and model.config.tie_word_embeddings
    got = _greedy(d, PROMPTS)
    assert got == hf_greedy(d, PROMPTS, N)
    assert got != _greedy(tiny_llama_dir, PROMPTS)  # the head really is the embedding now
