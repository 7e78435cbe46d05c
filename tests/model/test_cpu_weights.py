"""``cpu_weights=bf16``, the opt-in bf16 weight stream: its only numeric change is rounding the projection
and LM head weights to bf16 (activations, accumulation and the embedding stay fp32), so a model run with
it generates what the fp32 engine generates from a checkpoint whose those weights were rounded; and it is
refused where it cannot apply."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve.kernels import cpu_ext
from kvserve.workers.core.sampling_params import SamplingParams
from kvserve.workers.engine.engine import LLM
from kvserve.workers.models import cpu_gemm
from tests.model.test_loader import _copy_without

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason="the bf16 weight stream is the C++ GEMM's")

N_NEW = 12


@pytest.fixture(scope="module")
def rounded_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama (untied head) with every projection and the LM head rounded to bf16, stored as fp32."""
    out = _copy_without(tiny_llama_dir, tmp_path_factory.mktemp("tiny-llama-bf16-rounded"), "model.safetensors")
    weights = load_file(str(tiny_llama_dir / "model.safetensors"))
    rounded = {
        name: w.bfloat16().float() if w.dim() == 2 and "embed_tokens" not in name else w
        for name, w in weights.items()
    }
    assert sum(not torch.equal(rounded[n], weights[n]) for n in weights) > 8
    save_file(rounded, str(out / "model.safetensors"))
    return out


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    # NOTE: 200 tokens take the prefill path above PACKED_MAX_ROWS (MKL on the widened weight), the
    # short ones the packed bf16 tiles; decode is the packed tiles.
    return [torch.randint(0, 32000, (n,), generator=g).tolist() for n in (3, 17, 200)]


def _run(model_dir: Path, cpu_weights: str) -> list:
    llm = LLM(str(model_dir), block_size=4, num_gpu_blocks=256, cpu_weights=cpu_weights)
    return llm.generate(_prompts(), SamplingParams(max_tokens=N_NEW, temperature=0.0, ignore_eos=True, logprobs=2))


def test_bf16_weights_generate_what_fp32_generates_from_the_rounded_checkpoint(
    tiny_llama_dir: Path, rounded_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # NOTE: the same GEMM for the reference (the timed choice may pick oneDNN, whose sums round differently)
    monkeypatch.setenv(cpu_gemm.ENV_OVERRIDE, "kvserve")
    bf16 = _run(tiny_llama_dir, "bf16")
    reference = _run(rounded_dir, "fp32")
    exact = _run(tiny_llama_dir, "fp32")
    moved = 0.0
    for ours, ref, fp32 in zip(bf16, reference, exact, strict=True):
        assert ours.token_ids == ref.token_ids
        for a, b, c in zip(ours.logprobs, ref.logprobs, fp32.logprobs, strict=True):
            assert a.keys() == b.keys()
            for tid in a:
                assert a[tid] == pytest.approx(b[tid], abs=1e-5)
                if tid in c:
                    moved = max(moved, abs(a[tid] - c[tid]))
    assert moved > 1e-4, "the bf16 mode computed the fp32 logprobs: its weights were not rounded"


def test_bf16_weights_log_their_packing(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), block_size=4, num_gpu_blocks=64, cpu_weights="bf16")
    model = llm.engine.model
    assert model.gemm_choice is not None and model.gemm_choice.packing == cpu_gemm.BF16_PACKING
    assert "bf16 weights" in model.cpu_gemm_summary()
    assert llm.engine.model_id.endswith("#cpu_weights=bf16")  # its prefix blocks never meet fp32 ones


def test_bf16_weights_on_a_bf16_model_are_refused(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="cpu_weights=bf16 applies to a float32 model on CPU"):
        LLM(str(tiny_llama_dir), block_size=4, num_gpu_blocks=64, cpu_weights="bf16", dtype="bfloat16")


def test_an_unknown_cpu_weights_mode_is_refused(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="cpu_weights"):
        LLM(str(tiny_llama_dir), block_size=4, num_gpu_blocks=64, cpu_weights="int8")
