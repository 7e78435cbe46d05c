"""The clients of ``kvserve bench compare-serve``: their command lines (identical for every target but the
URL), reading their result files, and what the report says about the setup and the machine.

``vllm bench serve`` is vLLM's own client from the peer venv (``--backend openai``: ``/v1/completions``,
streamed), run greedy with ``--ignore-eos`` so that every target generates the same number of tokens;
``guidellm`` is a second, independent client (synthetic prompts of the same lengths, fixed concurrency).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from kvserve.cluster.bench.compare_serve_report import ClientResult, ResultError, parse_guidellm, parse_vllm_bench

WORKLOADS = ("random", "prefix_repetition")


@dataclass(frozen=True)
class BenchSpec:
    """What every target is driven with (one object, so no target can get different arguments)."""

    model: str  # the served name the client asks for
    tokenizer: str  # the model directory (the client counts tokens with its tokenizer)
    workload: str
    num_prompts: int
    max_concurrency: int
    seed: int
    input_len: int = 256
    output_len: int = 64
    prefix_len: int = 512
    suffix_len: int = 64
    num_prefixes: int = 8
    prefix_output_len: int = 32


def bench_spec_from_args(args: argparse.Namespace, served_name: str) -> BenchSpec:
    """The ``BenchSpec`` of ``compare-serve``'s options."""
    return BenchSpec(
        model=served_name, tokenizer=args.model, workload=args.workload, num_prompts=args.num_prompts,
        max_concurrency=args.max_concurrency, seed=args.seed, input_len=args.input_len, output_len=args.output_len,
        prefix_len=args.prefix_len, suffix_len=args.suffix_len, num_prefixes=args.num_prefixes,
        prefix_output_len=args.prefix_output_len,
    )  # fmt: skip


def vllm_bench_command(vllm: str, base_url: str, spec: BenchSpec, result_file: Path) -> list[str]:
    """``vllm bench serve`` against ``base_url``, saving its JSON result to ``result_file``."""
    argv = [
        vllm, "bench", "serve", "--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
        "--model", spec.model, "--tokenizer", spec.tokenizer, "--dataset-name", spec.workload,
        "--num-prompts", str(spec.num_prompts), "--max-concurrency", str(spec.max_concurrency),
        "--seed", str(spec.seed), "--temperature", "0", "--ignore-eos",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
        # NOTE: --save-detailed keeps each request's TTFT, ITLs and start time in the log (a round's
        # medians alone hid why some rounds fall in a slower mode).
        "--save-result", "--save-detailed", "--result-dir", str(result_file.parent),
        "--result-filename", result_file.name, "--disable-tqdm",
    ]  # fmt: skip
    if spec.workload == "random":
        argv += ["--random-input-len", str(spec.input_len), "--random-output-len", str(spec.output_len)]
    elif spec.workload == "prefix_repetition":
        argv += ["--prefix-repetition-prefix-len", str(spec.prefix_len),
                 "--prefix-repetition-suffix-len", str(spec.suffix_len),
                 "--prefix-repetition-num-prefixes", str(spec.num_prefixes),
                 "--prefix-repetition-output-len", str(spec.prefix_output_len)]  # fmt: skip
    else:
        raise ValueError(f"unknown workload {spec.workload!r} (expected one of {WORKLOADS})")
    return argv


def read_vllm_bench(result_file: Path) -> ClientResult:
    """Parse the file ``vllm bench serve --save-result`` wrote.

    Raises:
        ResultError: no such file, not JSON, or a figure missing.
    """
    try:
        return parse_vllm_bench(json.loads(result_file.read_text()))
    except (OSError, json.JSONDecodeError) as e:
        raise ResultError(f"cannot read the vllm bench serve result {result_file}: {e}") from e


def read_vllm_bench_output_tokens(result_file: Path) -> int | None:
    """The tokens the benchmark streamed (``total_output_tokens`` of the saved result), or None."""
    try:
        value = json.loads(result_file.read_text()).get("total_output_tokens")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    return int(value) if isinstance(value, int) and value > 0 else None


def read_vllm_bench_duration(result_file: Path) -> float | None:
    """The benchmark's duration in seconds (``duration`` of the saved result), or None without one."""
    try:
        value = json.loads(result_file.read_text()).get("duration")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    return float(value) if isinstance(value, int | float) and value > 0 else None


def read_guidellm(work: Path) -> ClientResult:
    """Parse the JSON report ``guidellm_command`` asked for (``work/guidellm.json``).

    Raises:
        ResultError: no such file, not JSON, or a figure missing.
    """
    path = work / "guidellm.json"
    try:
        return parse_guidellm(json.loads(path.read_text()))
    except (OSError, json.JSONDecodeError) as e:
        raise ResultError(f"cannot read the guidellm result {path}: {e}") from e


def cpu_description(cpuinfo: str) -> tuple[str, str]:
    """``(model name, the SIMD flags that matter here)`` from ``/proc/cpuinfo`` text."""
    model, flags = "unknown CPU", set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model == "unknown CPU":
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    shown = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16") if f in flags]
    return model, " ".join(shown) or "no AVX2"


def machine() -> dict:
    """CPU model and flags, usable cores and the load average, for the report."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    cpu, flags = cpu_description(text)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None
    return {"cpu": cpu, "flags": flags, "cores": cores, "load_average": load}


def describe(args: argparse.Namespace, served_name: str, plan: list) -> dict:
    """The setup, for the report: the client's spec and each target's command lines."""
    spec = bench_spec_from_args(args, served_name)
    return {
        "model": args.model,
        "client": f"vllm bench serve {spec.workload}, {spec.num_prompts} prompts, concurrency {spec.max_concurrency}, "
        f"seed {spec.seed}, greedy, ignore_eos",
        "spec": asdict(spec),
        "runs": args.runs,
        "targets": [t.name for t in plan],
        "commands": {t.name: [" ".join(p.argv) for p in t.procs] for t in plan},
        "env": {t.name: [p.env for p in t.procs] for t in plan},
    }


def guidellm_scenario(base_url: str, spec: BenchSpec, result_file: Path) -> dict:
    """A guidellm (0.8) scenario: synthetic prompts of ``spec.input_len`` tokens, ``spec.output_len`` out,
    ``spec.max_concurrency`` streams, ``spec.num_prompts`` requests, greedy, against ``/v1/completions``.

    NOTE: a scenario file, not ``--backend kind=...`` flags: the flags cannot say ``temperature: 0``
    (a nested request body); guidellm sets ``ignore_eos`` itself when the data fixes the output length.
    """
    if spec.workload != "random":
        raise ValueError(f"guidellm has no {spec.workload!r} workload here (random only)")
    return {"spec": {
        "backend": {"kind": "openai_http", "target": base_url, "model": spec.model,
                    "request_format": "/v1/completions", "extras": {"body": {"temperature": 0}}},
        "profile": {"kind": "concurrent", "streams": [spec.max_concurrency]},
        "constraints": [{"kind": "max_requests", "count": spec.num_prompts}],
        "tokenizer": {"kind": "hf_auto", "model": spec.tokenizer},
        "data": [{"kind": "synthetic_text", "prompt_tokens": spec.input_len, "output_tokens": spec.output_len}],
        "seed": {"kind": "static", "value": spec.seed},
        "outputs": [{"kind": "json", "path": str(result_file)}],
    }}  # fmt: skip


def guidellm_command(guidellm: str, base_url: str, spec: BenchSpec, work: Path) -> list[str]:
    """``guidellm run`` with a scenario file written to ``work`` (its JSON report goes there too)."""
    work.mkdir(parents=True, exist_ok=True)
    scenario = work / "scenario.json"
    scenario.write_text(json.dumps(guidellm_scenario(base_url, spec, work / "guidellm.json"), indent=1))
    return [guidellm, "run", "--scenario", str(scenario), "--disable-console-interactive"]
