"""``kvserve bench offline`` end to end on a tiny random model with a subsampled workload."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvserve.cluster.bench.offline import RESULT_KEYS
from kvserve.cluster.bench.workloads import prompts
from kvserve.cluster.cli import main
from kvserve.workers.models.random_model import init_random


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tiny")
    init_random(d, arch="llama", size="tiny", seed=0)
    return d


def test_offline_json(model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dump = tmp_path / "tokens.json"
    argv = ["bench", "offline", "--model", str(model_dir), "--workload", "tiny", "--json", "--runs", "2",
            "--num-requests", "6", "--max-tokens", "5", "--kv-cache-memory", "64MiB",
            "--dump-tokens", str(dump)]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)

    assert set(RESULT_KEYS) <= set(result)
    assert result["output_tokens_per_s"] > 0
    assert result["total_tokens_per_s"] > result["output_tokens_per_s"]
    assert result["requests_per_s"] > 0
    assert 0 < result["step_latency_mean_ms"] <= result["step_latency_p99_ms"]
    assert 0 <= result["overhead_share"] < 1
    assert result["peak_rss_mb"] > 0
    assert 0 <= result["kv_waste"] <= 1
    assert result["runs"] == 2 and result["num_requests"] == 6
    assert result["engine"]["block_size"] > 0 and result["engine"]["dtype"] == "float32"

    dumped = json.loads(dump.read_text())
    assert [len(t) for t in dumped["token_ids"]] == [5] * 6  # ignore_eos: every request runs to max tokens
    assert [len(lp) for lp in dumped["logprobs"]] == [5] * 6
    assert all(lp <= 0 for row in dumped["logprobs"] for lp in row)


def test_offline_tokens_match_offline_llm(model_dir: Path, tmp_path: Path) -> None:
    """The bench's greedy tokens are the ones ``LLM.generate`` produces for the same prompts."""
    from kvserve.workers.core.sampling_params import SamplingParams
    from kvserve.workers.engine.engine import LLM

    dump = tmp_path / "tokens.json"
    argv = ["bench", "offline", "--model", str(model_dir), "--workload", "tiny", "--json", "--runs", "1",
            "--num-requests", "3", "--max-tokens", "4", "--kv-cache-memory", "64MiB", "--block-size", "16",
            "--dump-tokens", str(dump)]  # fmt: skip
    assert main(argv) == 0
    ps, _ = prompts("tiny")
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory="64MiB")
    outs = llm.generate(ps[:3], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert json.loads(dump.read_text())["token_ids"] == [o.token_ids for o in outs]


def test_reference_tokens_report_agreement_and_logprob_delta(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["bench", "offline", "--model", str(model_dir), "--workload", "tiny", "--json", "--runs", "1",
            "--num-requests", "4", "--max-tokens", "6", "--kv-cache-memory", "64MiB"]  # fmt: skip
    ref = tmp_path / "fp32.json"
    assert main([*base, "--dump-tokens", str(ref)]) == 0
    capsys.readouterr()
    assert main([*base, "--reference-tokens", str(ref)]) == 0
    same = json.loads(capsys.readouterr().out)
    assert same["token_agreement"] == 1.0 and same["logprob_delta"] == 0.0 and same["logprob_positions"] == 24
    assert main([*base, "--reference-tokens", str(ref), "--kv-cache-dtype", "int8"]) == 0
    int8 = json.loads(capsys.readouterr().out)
    assert 0 < int8["logprob_delta"] < 0.5  # quantized KV moves logprobs, a little
    assert 0 <= int8["token_agreement"] <= 1


def test_kernels_subcommand_registered(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["bench", "kernels", "--help"])
    assert e.value.code == 0
    assert "usage" in capsys.readouterr().out
