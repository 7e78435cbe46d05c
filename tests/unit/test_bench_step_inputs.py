"""`kvserve bench step-inputs`: one row per batch size, timed through the real ``StepBuffers.stage``."""

from __future__ import annotations

import json

import pytest

from kvserve.cluster.bench.step_inputs import BLOCK_SIZE, decode_batch
from kvserve.cluster.cli import main


def test_cli_json_rows(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "step-inputs", "--batches", "1,8", "--steps", "3", "--runs", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["batch"] for r in out["rows"]] == [1, 8]
    assert all(r["us_per_step"] > 0 and len(r["runs"]) == 2 for r in out["rows"])


def test_the_synthetic_batch_is_mid_decode_with_a_table_per_context() -> None:
    for req, n in decode_batch(16, 200, 4096):
        assert n == 1 and req.num_computed_tokens == req.num_tokens - 1
        assert len(req.block_table) == -(-req.num_tokens // BLOCK_SIZE)
