"""The kernel bench's dry mode (CPU interpreter, tiny sizes) through cluster/bench/gpu_check.sh --dry-run."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess

import pytest

from cluster.bench import kernels as bench

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "cluster" / "bench" / "gpu_check.sh"


def test_arguments_parse() -> None:
    parser = bench.add_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--batches", "1,16", "--check-dtypes", "bf16,fp16", "--json-out", "x.json"])
    assert args.batches == [1, 16] and args.contexts == [512, 4096, 32768] and args.block_sizes == [16, 32]
    assert args.check_dtypes == ["bfloat16", "float16"] and args.json_out == "x.json" and not args.dry_run
    with pytest.raises(SystemExit):
        parser.parse_args(["--check-dtypes", "int8"])
    assert args.kv_cache_dtypes == ["auto", "fp8", "int8"]
    assert parser.parse_args(["--kv-cache-dtypes", "int8, fp8,int8"]).kv_cache_dtypes == ["int8", "fp8"]
    for bad in ("bf16", ""):
        with pytest.raises(SystemExit):
            parser.parse_args(["--kv-cache-dtypes", bad])


def test_gpu_check_dry_run_verifies_kernels(tmp_path: pathlib.Path) -> None:
    assert os.access(SCRIPT, os.X_OK), "gpu_check.sh must be executable"
    env = {**os.environ, "OUT": str(tmp_path)}
    proc = subprocess.run(
        [str(SCRIPT), "--dry-run"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "kernels_dry.json").read_text())
    assert result["mode"] == "dry-run" and result["checks_passed"]
    assert result["decode"] and result["prefill"]
    assert all(row["checks"] for row in result["decode"])
    assert any(name.endswith("-split") for row in result["decode"] for name in row["checks"])
    assert all(row["time_us"] is None for row in result["decode"])  # no timing claims in dry mode
    # Every grid point has an auto (query-dtype cache) row and fp8/int8 rows, each checked within tolerance.
    assert result["kv_cache_dtypes"] == ["auto", "fp8", "int8"]
    points = {(r["block_size"], r["batch"], r["context"]) for r in result["decode"]}
    by_kv = {kv: [r for r in result["decode"] if r["kv_cache_dtype"] == kv] for kv in ("auto", "fp8", "int8")}
    assert sum(map(len, by_kv.values())) == len(result["decode"])
    for kv, rows in by_kv.items():
        assert {(r["block_size"], r["batch"], r["context"]) for r in rows} == points, kv
        for row in rows:
            assert not row["skipped"] and row["checks"], (kv, row)
            assert any(name.endswith("-split") for name in row["checks"]), (kv, row)
            for name, err in row["checks"].items():
                assert err <= result["tolerance"][name.partition("/")[0]], (kv, name, err)
            if kv == "auto":
                assert row["store_rel_err"] is None
            else:  # the store kernel quantized the K/V (not, say, left the cache zero)
                assert 0 < row["store_rel_err"] <= result["store_tolerance"][kv], (kv, row)
