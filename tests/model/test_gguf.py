"""GGUF checkpoints, without a download: random tiny checkpoints written as llama.cpp would write them
(q/k rows permuted for Llama, ggml quantization, BPE vocabulary and merges in the metadata), then served
directly. Weights must equal the HF directory's (after the same quantization), tokens HF's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

gguf = pytest.importorskip("gguf")

from kvserve.workers.core.sampling_params import SamplingParams  # noqa: E402
from kvserve.workers.engine.engine import LLM  # noqa: E402
from kvserve.workers.models.gguf_checkpoint import find_gguf, unpermute_rotary_rows  # noqa: E402
from kvserve.workers.models.loader import load_model  # noqa: E402
from kvserve.workers.models.model_config import ModelConfig  # noqa: E402
from kvserve.workers.text.tokenizer import load_tokenizer  # noqa: E402

Q = gguf.GGMLQuantizationType
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}  # fmt: skip
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}  # fmt: skip


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """``convert_hf_to_gguf.py``'s ``LlamaModel.permute``, verbatim in torch."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, idx, rest = hf_name.split(".", 3)
    return f"blk.{idx}.{_LAYER[rest]}"


def quantizable(qtype, tensor: torch.Tensor) -> bool:
    return tensor.dim() == 2 and tensor.shape[1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0


def write_gguf(hf_dir: Path, out: Path, qtype=Q.F32) -> dict[str, torch.Tensor]:
    """Write ``hf_dir`` as llama.cpp's converter would, 2-D weights as ``qtype`` where their rows
    split into its blocks (else F16). Returns the HF tensors as the quantization leaves them."""
    config = json.loads((hf_dir / "config.json").read_text())
    arch = config["model_type"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(config["head_dim"])
    w.add_value_length(config["head_dim"])
    w.add_rope_freq_base(config["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_vocab_size(config["vocab_size"])
    tok_json = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = tok_json["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in tok_json["added_tokens"] if t["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok_json["model"]["merges"]])
    w.add_bos_token_id(config["bos_token_id"])
    w.add_eos_token_id(config["eos_token_id"])
    w.add_add_bos_token(True)
    expected: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(hf_dir / "model.safetensors").items():
        qt = qtype if quantizable(qtype, tensor) else (Q.F16 if tensor.dim() == 2 else Q.F32)
        data = gguf.quants.quantize(tensor.float().numpy(), qt)
        expected[name] = torch.from_numpy(gguf.quants.dequantize(data, qt).copy())
        if arch == "llama" and name.endswith("q_proj.weight"):
            data = gguf.quants.quantize(llama_cpp_permute(tensor.float(), heads).numpy(), qt)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            data = gguf.quants.quantize(llama_cpp_permute(tensor.float(), kv_heads).numpy(), qt)
        w.add_tensor(gguf_name(name), data, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def assert_weights(model_path: Path, hf_dir: Path, expected: dict[str, torch.Tensor]) -> None:
    """The model loaded from ``model_path`` holds exactly ``expected`` (in the loader's fused layout,
    which loading ``hf_dir`` with ``expected`` as its weights gives)."""
    served = load_model(model_path, torch.float32).state_dict()
    reference = load_model(hf_dir, torch.float32)
    with torch.no_grad():  # overwrite the HF weights by the expected ones through the same fusing
        from kvserve.workers.models.loader import _targets

        for name, tensor in expected.items():
            param, offset, rows = _targets(reference, name)
            param[offset : offset + rows].copy_(tensor)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(served[name], tensor), name


def test_unpermute_inverts_llama_cpp_permute() -> None:
    w = torch.randn(6 * 8, 5)
    for heads in (1, 2, 6):
        assert torch.equal(unpermute_rotary_rows(llama_cpp_permute(w, heads), heads), w)
    assert not torch.equal(llama_cpp_permute(w, 6), w)


@pytest.fixture(scope="module")
def llama_gguf(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.f32.gguf"
    write_gguf(tiny_llama_dir, path)
    return path


def test_f32_llama_gguf_serves_hf_tokens(tiny_llama_dir: Path, llama_gguf: Path, hf_greedy) -> None:
    assert ModelConfig.from_dir(llama_gguf) == ModelConfig.from_dir(tiny_llama_dir)
    assert_weights(llama_gguf, tiny_llama_dir, load_file(tiny_llama_dir / "model.safetensors"))
    prompts = [[1, 5, 900, 31000, 7], list(range(3, 40))]
    outs = LLM(str(llama_gguf), device="cpu", block_size=4, num_gpu_blocks=64).generate(
        prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    )
    assert [o.token_ids for o in outs] == hf_greedy(tiny_llama_dir, prompts, 24)


def test_gguf_tokenizer_equals_hf_dir(tiny_llama_dir: Path, llama_gguf: Path) -> None:
    from_dir, from_gguf = load_tokenizer(tiny_llama_dir), load_tokenizer(llama_gguf)
    assert from_dir is not None and from_gguf is not None
    for text in ("Hello world", " leading space, digits 12345!", "naïve café 🙂\n\ttabs", "</s> special"):
        assert from_gguf.encode(text) == from_dir.encode(text), text
        assert from_gguf.decode(from_gguf.encode(text)) == from_dir.decode(from_dir.encode(text))
    assert from_gguf.eos_token_ids == from_dir.eos_token_ids == (2, 31999)  # </s>, <|im_end|>


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "F16"])
def test_quantized_gguf_dequantizes_at_load(tiny_llama_dir: Path, tmp_path: Path, qtype: str) -> None:
    path = tmp_path / f"tiny-llama.{qtype}.gguf"
    expected = write_gguf(tiny_llama_dir, path, Q[qtype])
    assert_weights(path, tiny_llama_dir, expected)


def test_qwen3_gguf_not_permuted(tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "tiny-qwen3.gguf"
    expected = write_gguf(tiny_qwen3_dir, path)
    config = ModelConfig.from_dir(path)
    assert config.family == "qwen3" and config.qk_norm and config.head_dim == 64
    assert_weights(path, tiny_qwen3_dir, expected)


def test_find_gguf(tmp_path: Path, llama_gguf: Path) -> None:
    assert find_gguf(llama_gguf) == llama_gguf
    assert find_gguf(llama_gguf.parent) == llama_gguf  # a directory holding one
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "x.gguf").write_bytes(b"")
    assert find_gguf(tmp_path) is None  # an HF directory wins
    two = tmp_path / "two"
    two.mkdir()
    (two / "a.gguf").write_bytes(b"")
    (two / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="several GGUF"):
        find_gguf(two)
    with pytest.raises(ValueError, match="not a readable GGUF"):
        load_model(tmp_path / "x.gguf")


def test_a_gguf_models_tokenizer_and_template_load_without_torch(llama_gguf: Path) -> None:
    """What the router reads of a GGUF model (tokenizer, chat template, limits) needs no torch: a router
    serving a GGUF model must not pay torch's import and memory (kvserve/workers/text/gguf_metadata.py)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from kvserve.workers.text.chat_template import ChatTemplate\n"
        "from kvserve.workers.text.tokenizer import load_tokenizer\n"
        f"tok = load_tokenizer({str(llama_gguf)!r})\n"
        f"ChatTemplate.from_dir({str(llama_gguf)!r})\n"
        "assert tok.encode('Hello world'), 'no ids'\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False", "loading a GGUF tokenizer imported torch"
