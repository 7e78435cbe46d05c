"""The random HF checkpoint: deterministic, loadable by transformers, sharding, tokenizer, CLI."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from kvserve.workers.models.random_model import (
    SIZES,
    VOCAB_SIZE,
    add_init_random_arguments,
    init_random,
    parse_size,
    run_init_random,
)

TEXT = "Hello, world! héllo ✓"


@pytest.fixture(scope="module")
def llama_dir(tiny_llama_dir: Path) -> Path:
    return tiny_llama_dir  # the session's checkpoint: init_random(arch="llama", size="tiny", seed=0)


@pytest.fixture(scope="module")
def qwen2_dir(tiny_qwen2_dir: Path) -> Path:
    return tiny_qwen2_dir  # init_random(arch="qwen2", size="tiny", seed=0)


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_deterministic_by_seed(tmp_path: Path, llama_dir: Path) -> None:
    again = tmp_path / "again"
    init_random(again, arch="llama", size="tiny", seed=0)
    assert _files(again) == _files(llama_dir)

    other = tmp_path / "other"
    init_random(other, arch="llama", size="tiny", seed=1)
    assert (other / "model.safetensors").read_bytes() != (llama_dir / "model.safetensors").read_bytes()


def test_config_and_files(llama_dir: Path, qwen2_dir: Path) -> None:
    names = {p.name for p in llama_dir.iterdir()}
    assert names == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    }
    llama = json.loads((llama_dir / "config.json").read_text())
    tiny = SIZES["tiny"]
    assert llama["architectures"] == ["LlamaForCausalLM"] and llama["model_type"] == "llama"
    assert (llama["vocab_size"], llama["hidden_size"], llama["num_hidden_layers"]) == (VOCAB_SIZE, 256, 4)
    assert (llama["num_attention_heads"], llama["num_key_value_heads"]) == (8, 2)
    assert llama["intermediate_size"] == tiny.intermediate_size and llama["attention_bias"] is False
    assert (llama["bos_token_id"], llama["eos_token_id"], llama["tie_word_embeddings"]) == (1, 2, False)
    qwen2 = json.loads((qwen2_dir / "config.json").read_text())
    assert qwen2["architectures"] == ["Qwen2ForCausalLM"] and qwen2["use_sliding_window"] is False


def test_weights_names_and_init(llama_dir: Path, qwen2_dir: Path) -> None:
    llama = load_file(llama_dir / "model.safetensors")
    qwen2 = load_file(qwen2_dir / "model.safetensors")
    assert "model.layers.0.self_attn.q_proj.bias" not in llama
    biases = {k for k in qwen2 if k.endswith(".bias")}
    assert biases == {f"model.layers.{i}.self_attn.{p}_proj.bias" for i in range(4) for p in "qkv"}
    assert set(qwen2) - biases == set(llama)
    assert llama["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 32, 256)  # [kv_dim, hidden]
    assert llama["model.layers.3.mlp.down_proj.weight"].shape == (256, 688)
    assert torch.equal(llama["model.norm.weight"], torch.ones(256))
    std = llama["model.embed_tokens.weight"].std().item()
    assert abs(std - 0.02) < 0.001
    assert all(t.dtype == torch.float32 for t in llama.values())


def _check_transformers(model_dir: Path) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    with torch.no_grad():
        logits = model(torch.tensor([[1, 100, 2000, 31999]])).logits
    assert logits.shape == (1, 4, VOCAB_SIZE) and torch.isfinite(logits).all()
    return model


def test_llama_loads_in_transformers(llama_dir: Path) -> None:
    model = _check_transformers(llama_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    ours = load_file(llama_dir / "model.safetensors")
    assert torch.equal(model.lm_head.weight, ours["lm_head.weight"])


def test_qwen2_loads_in_transformers_with_biases(qwen2_dir: Path) -> None:
    model = _check_transformers(qwen2_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    ours = load_file(qwen2_dir / "model.safetensors")
    bias = model.model.layers[1].self_attn.k_proj.bias
    assert bias is not None and torch.equal(bias, ours["model.layers.1.self_attn.k_proj.bias"])


def test_tokenizer_in_transformers(llama_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    auto = transformers.AutoTokenizer.from_pretrained(llama_dir)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(llama_dir / "tokenizer.json"))
    for tok in (auto, fast):
        ids = tok.encode(TEXT)
        assert ids[0] == 1  # <s>
        assert tok.decode(ids, skip_special_tokens=True) == TEXT
    assert len(fast) == VOCAB_SIZE
    assert auto.eos_token_id == 2 and auto.bos_token_id == 1


def test_every_id_decodes(llama_dir: Path) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(llama_dir / "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE
    assert sorted(tok.get_vocab(with_added_tokens=True).values()) == list(range(VOCAB_SIZE))
    assert (tok.id_to_token(0), tok.id_to_token(1), tok.id_to_token(2)) == ("<unk>", "<s>", "</s>")
    assert all(tok.decode([i], skip_special_tokens=False) for i in range(VOCAB_SIZE))


def test_sharded_index(tmp_path: Path, llama_dir: Path) -> None:
    max_bytes = 10_000_000  # embed/lm_head (32.8 MB each) exceed it: they get shards of their own
    init_random(tmp_path, arch="llama", size="tiny", seed=0, max_shard_bytes=max_bytes)
    assert not (tmp_path / "model.safetensors").exists()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    weight_map: dict[str, str] = index["weight_map"]
    shards = sorted(set(weight_map.values()))
    n = len(shards)
    assert n > 2 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(p.name for p in tmp_path.glob("model-*.safetensors")) == shards

    whole = load_file(llama_dir / "model.safetensors")
    assert set(weight_map) == set(whole)
    total = 0
    for shard in shards:
        part = load_file(tmp_path / shard)
        assert all(weight_map[k] == shard for k in part)
        size = sum(t.numel() * t.element_size() for t in part.values())
        assert size <= max_bytes or len(part) == 1
        total += size
        for k, t in part.items():
            assert torch.equal(t, whole[k])  # same tensors as the unsharded checkpoint
    assert index["metadata"]["total_size"] == total
    with safe_open(tmp_path / shards[0], "pt") as f:
        assert f.metadata() == {"format": "pt"}
    _check_transformers(tmp_path)


def test_resharding_removes_stale_files(tmp_path: Path) -> None:
    init_random(tmp_path, max_shard_bytes=10_000_000)
    init_random(tmp_path)  # unsharded now
    assert not list(tmp_path.glob("model-*")) and not (tmp_path / "model.safetensors.index.json").exists()


def test_bfloat16(tmp_path: Path) -> None:
    init_random(tmp_path, arch="qwen2", dtype="bfloat16")
    weights = load_file(tmp_path / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"


@pytest.mark.parametrize(
    "kwargs",
    [{"arch": "gpt2"}, {"size": "huge"}, {"dtype": "int8"}, {"max_shard_bytes": 0}],
)
def test_bad_arguments(tmp_path: Path, kwargs: dict) -> None:
    with pytest.raises(ValueError):
        init_random(tmp_path, **kwargs)


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_init_random_arguments(parser)
    out = tmp_path / "m"
    args = parser.parse_args(
        ["--arch", "qwen2", "--size", "tiny", "--seed", "3", "--max-shard-size", "20MB", str(out)]
    )
    assert args.max_shard_size == 20_000_000
    assert run_init_random(args) == 0
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "qwen2" in err and "M params" in err and str(out.resolve()) in err
    assert (out / "model.safetensors.index.json").exists()


def test_parse_size() -> None:
    assert parse_size("123") == 123
    assert parse_size("50MB") == 50_000_000
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("4kib") == 4096
    for bad in ("", "0", "-5", "MB", "1.5GB", "10XB"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_size(bad)
