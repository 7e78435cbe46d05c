"""kvserve/cluster/bench/gpu_check.sh --dry-run: every step of the GPU check on CPU with tiny sizes, in an
interpreter that, like the GPU machine's, lacks Ray, rich, jinja2, gguf, prometheus_client, psutil and
pytest (so an import of one of them at the wrong place fails here, not in a scarce GPU minute)."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from kvserve.cluster.bench import kernels as bench

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "kvserve" / "cluster" / "bench" / "gpu_check.sh"
# Distributions the GPU machine does not have (it has torch, triton, transformers, safetensors,
# tokenizers, grpcio, protobuf, numpy and their dependencies).
ABSENT = ("ray", "rich", "jinja2", "gguf", "prometheus_client", "psutil", "pytest", "_pytest", "pluggy")


def _gpu_machine_python(tmp: pathlib.Path) -> pathlib.Path:
    """A wrapper running this interpreter without ``site`` over a copy (symlinks) of its site-packages
    minus ``ABSENT``: those modules are then missing, as on the GPU machine, not merely broken."""
    farm = tmp / "site"
    farm.mkdir()
    absent = re.compile(rf"^({'|'.join(ABSENT)})([-.].*)?$", re.IGNORECASE)
    for entry in map(pathlib.Path, sys.path):
        if entry.name != "site-packages" or not entry.is_dir():
            continue
        for item in entry.iterdir():
            if not absent.match(item.name) and item.suffix != ".pth" and not (farm / item.name).exists():
                (farm / item.name).symlink_to(item)
    wrapper = tmp / "python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH="$PYTHONPATH:{farm}" exec {sys.executable} -S "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def test_arguments_parse() -> None:
    parser = bench.add_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--batches", "1,16", "--check-dtypes", "bf16,fp16", "--json-out", "x.json"])
    assert args.batches == [1, 16] and args.contexts == [4096, 32768] and args.block_sizes == [16]
    assert args.prefix_lens == [1024, 8192] and args.prefix_new_tokens == 512 and args.prefill_lens == [2048, 8192]
    assert args.check_dtypes == ["bfloat16", "float16"] and args.json_out == "x.json" and not args.dry_run
    with pytest.raises(SystemExit):
        parser.parse_args(["--check-dtypes", "int8"])
    assert args.kv_cache_dtypes == ["auto", "fp8", "int8"]
    assert parser.parse_args(["--kv-cache-dtypes", "int8, fp8,int8"]).kv_cache_dtypes == ["int8", "fp8"]
    for bad in ("bf16", ""):
        with pytest.raises(SystemExit):
            parser.parse_args(["--kv-cache-dtypes", bad])


def test_gpu_check_dry_run_runs_every_step(tmp_path: pathlib.Path) -> None:
    assert os.access(SCRIPT, os.X_OK), "gpu_check.sh must be executable"
    out = tmp_path / "out"
    python = _gpu_machine_python(tmp_path)
    probe = subprocess.run([str(python), "-c", "import ray"], capture_output=True, text=True, cwd=ROOT)
    assert probe.returncode != 0 and "No module named 'ray'" in probe.stderr  # the fake machine is faithful
    env = {**os.environ, "OUT": str(out), "PYTHON": str(python), "KVSERVE_GPU_CHECK_WORK": str(tmp_path / "work")}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [str(SCRIPT), "--dry-run"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    summary = (out / "summary.txt").read_text()
    assert proc.returncode == 0, summary + proc.stdout[-3000:] + proc.stderr[-3000:]
    for step in ("env", "parity", "kv_smoke", "swap_migration", "tier", "kernels", "offline"):
        assert re.search(rf"^ok +{step} ", summary, re.MULTILINE), summary
    assert "skipped  ray:" in summary
    assert "rich: absent" in (out / "env.log").read_text()

    parity = json.loads((out / "parity.json").read_text())
    assert parity["passed"] and parity["device"] == "cpu" and parity["dry_run"]
    assert set(parity["models"]) == {"llama-tiny", "qwen2-tiny"}
    assert all(m["requests_equal"] == m["requests"] == 3 for m in parity["models"].values())
    kv = json.loads((out / "kv_smoke.json").read_text())
    assert kv["passed"] and set(kv["runs"]) == {"fp32", "bf16", "fp32+fp8-kv", "fp32+int8-kv"}
    assert {r["kv_dtype"] for r in kv["runs"].values()} == {"float32", "bfloat16", "float8_e4m3fn", "int8"}
    assert kv["runs"]["fp32"]["identical_tokens_vs_fp32"] == 1.0
    swap = json.loads((out / "swap_migration.json").read_text())
    assert swap["passed"] and set(swap["kv"]) == {"auto", "int8"}
    assert all(r["swap_preemptions"] > 0 and r["migration_tokens_equal"] for r in swap["kv"].values())
    tier = json.loads((out / "tier.json").read_text())
    assert tier["passed"] and set(tier["kv"]) == {"auto", "int8"}
    for kv, row in tier["kv"].items():  # each tier served the whole prompt, tokens as a recompute's
        assert set(row) == {"host", "disk"}, kv
        assert all(r["loaded_tokens"] == r["prompt_tokens"] and r["tokens_equal"] for r in row.values()), kv
        assert all(r["copier"] == "TierCopier" and r["load_recompute_ratio"] > 0 for r in row.values()), kv
    offline = json.loads((out / "offline.json").read_text())
    assert offline["passed"] and offline["rows"]["tiny"]["num_requests"] == 4
    for step in ("engine_1b", "decode_profile"):  # their figures: test_engine_speed_steps_dry
        assert re.search(rf"^ok +{step} ", summary, re.MULTILINE), summary

    result = json.loads((out / "kernels_dry.json").read_text())
    assert result["mode"] == "dry-run" and result["checks_passed"]
    assert result["decode"] and result["prefill"]
    _check_prefill_rows(result)
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


def _check_prefill_rows(result: dict) -> None:
    """No-prefix rows check the paged kernel, its contiguous twin and SDPA; prefix rows the paged kernel
    reading the cached prefix through the block table, and SDPA on the gathered K/V; all within tolerance."""
    plain = [r for r in result["prefill"] if not r["prefix"]]
    prefixed = [r for r in result["prefill"] if r["prefix"]]
    assert plain and prefixed and {r["prefix"] for r in prefixed} == {17, 40}
    for row in result["prefill"]:
        kinds = {name.partition("/")[2] for name in row["checks"]}
        assert kinds == ({"", "sdpa", "contiguous"} if not row["prefix"] else {"", "sdpa"}), row
        for name, err in row["checks"].items():
            assert err <= result["tolerance"][name.partition("/")[0]], (row, name)
        assert row["triton_us"] is None and row["sdpa_gather_us"] is None  # no timing claims in dry mode
    assert result["reference_bandwidth_gbs"] is None and result["nominal_bandwidth_gbs"] is None


def test_kernels_dry_run_prints_rows_as_it_goes(tmp_path: pathlib.Path) -> None:
    """The kernel bench alone: a line per row while it runs (before the tables), the prefix rows included."""
    out = tmp_path / "k.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "COLUMNS": "200"}
    proc = subprocess.run(
        [sys.executable, "-m", "kvserve.cluster.bench.kernels", "--dry-run", "--json-out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    _check_prefill_rows(result)
    lines = proc.stdout.splitlines()
    first_table = next(i for i, line in enumerate(lines) if "paged decode (" in line)
    streamed = lines[:first_table]
    assert sum(line.startswith("decode block=") for line in streamed) == len(result["decode"])
    assert sum(line.startswith("prefill block=") for line in streamed) == len(result["prefill"])
    assert any(line.startswith("prefill block=16 batch=1 prefix=40 new=9: ") for line in streamed)
    assert bench.nominal_bandwidth_gbs("NVIDIA H200") == 4800.0 and bench.nominal_bandwidth_gbs("cpu") is None
    assert bench.nominal_bandwidth_gbs("NVIDIA H100 80GB HBM3") == 3350.0


def test_engine_speed_steps_dry(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """gpu_check's engine_1b and decode_profile on CPU (tiny Llama; graphs "on" = the eager twin)."""
    from kvserve.cluster.bench import gpu_check

    monkeypatch.setenv("KVSERVE_GPU_CHECK_WORK", str(tmp_path / "work"))
    for step in ("engine_1b", "decode_profile"):
        assert gpu_check.main([step, "--device", "cpu", "--dry-run", "--out", str(tmp_path)]) == 0, step
    engine = json.loads((tmp_path / "engine_1b.json").read_text())
    assert engine["passed"] and engine["dry_run"] and engine["model"] == "llama-tiny"
    rows = engine["rows"]
    for name, n in (("decode_heavy", 16), ("mixed", 32)):
        on, off = rows[f"{name}/graphs_on"], rows[f"{name}/graphs_off"]
        assert on["graph_steps"] > 0 and off["graph_steps"] == 0, name
        assert on["requests"] == off["requests"] == n and on["output_tokens_per_s"] > 0
        assert rows[f"{name}/graphs_on_off_identical_requests"] == f"{n}/{n}"  # fp32: the same tokens
        assert rows[f"{name}/graphs_on_async"]["graph_steps"] > 0, name
        assert rows[f"{name}/async_on_off_identical_requests"] == f"{n}/{n}"  # overlap: the same tokens
    profile = json.loads((tmp_path / "decode_profile.json").read_text())
    assert profile["passed"] and set(profile["rows"]) == {
        f"batch_{b}/graphs_{g}" for b in (1, 2, 4) for g in ("on", "off")
    }
    for row in profile["rows"].values():
        assert row["wall_ms_per_step"] > 0 and row["aten_ops_per_step"] > 0
        assert row["launches_per_step"] is None and row["gpu_busy_share"] is None  # CUDA-only figures


def test_the_device_run_fits_its_eight_minutes() -> None:
    """Every step's time limit on a GPU, added up, stays within the 8 minutes a lent device gives the script
    (issue 37): a step that needs more must take it from another."""
    text = SCRIPT.read_text()
    device_part = text[text.index("no CUDA device here"):]
    budgets = [int(s) for s in re.findall(r"^\s*run_step \S+ (\d+) ", device_part, re.M)]
    assert len(budgets) >= 10, budgets
    assert sum(budgets) <= 480, f"gpu_check.sh's device steps may take {sum(budgets)} s > 480 s"
