"""``python -m kvserve.cluster.bench.cpu_peak``: shapes of the model cases and a tiny measured run."""

from __future__ import annotations

import json

import pytest

from kvserve.cluster.bench import cpu_peak


def test_model_cases_are_the_projection_shapes() -> None:
    tiny = {c.name: (c.m, c.k, c.n) for c in cpu_peak.model_cases("tiny", 64, "decode")}
    # hidden 256, 8 heads of 32, 2 KV heads: QKV = 256 + 2 * 64; intermediate 688; vocab 32000.
    assert tiny == {
        "tiny decode qkv": (64, 256, 384), "tiny decode o": (64, 256, 256), "tiny decode gate_up": (64, 256, 1376),
        "tiny decode down": (64, 688, 256), "tiny decode lm_head": (64, 256, 32000),
    }  # fmt: skip
    assert cpu_peak.GemmCase("x", 2, 3, 4).flops == 48


def test_square_run_reports_every_path(capsys: pytest.CaptureFixture[str]) -> None:
    assert cpu_peak.main(["--square-only", "--square", "128", "--repeats", "1", "--json", "--threads", "1"]) == 0
    result = json.loads(capsys.readouterr().out)
    (row,) = result["rows"]
    assert (row["m"], row["k"], row["n"]) == (128, 128, 128) and result["threads"] == 1
    assert row["mm_fp32"] > 0 and all(
        row[k] is None or row[k] > 0 for k in ("onednn_fp32", "onednn_bf16", "kvserve_fp32")
    )
    assert result["cpu"]
