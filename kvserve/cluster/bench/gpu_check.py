"""End-to-end checks of the engine on one device: the Python steps of ``kvserve/cluster/bench/gpu_check.sh``.

Each step is one process (``python -m kvserve.cluster.bench.gpu_check STEP``) so that the shell script can give
it its own time budget and a crash or a hang costs one step, not the run. A step writes
``OUT/STEP.json`` (``{"step", "passed", "device", ...figures}``) and exits 0 if it passed, 1 if not.

Steps (``--device cuda`` on the GPU machine; ``--device cpu --dry-run`` runs the same code on CPU with
tiny sizes so that ``make test`` keeps it from rotting):

* ``parity``: greedy fp32 tokens of ``LLM.generate`` equal HF transformers' ``generate`` on the same
  device, for random checkpoints written here (llama, qwen2; plus llama-small outside dry runs) and for
  a real checkpoint if ``KVSERVE_SMOLLM2_DIR`` names one. The first engine is sized by
  ``gpu_memory_utilization`` (CUDA), and the step records the pool it got.
* ``kv_smoke``: bf16 weights + KV, fp8 and int8 KV on fp32 weights: complete, in-vocabulary outputs;
  the share of tokens identical to the fp32 run is reported (lossy: not required to be 1).
* ``swap_migration``: a pool too small for the batch with ``preemption_mode="swap"`` (pinned host
  blocks on CUDA) and an export/import of a running request between two engines: tokens identical to
  an undisturbed run, swaps happened, every block back in its pool. fp32 and int8 KV.
* ``offline``: ``kvserve bench offline`` (``cluster.bench.offline``, no CLI extras) rows, JSON.
* ``engine_1b``, ``decode_profile``: the engine's speed on a Llama-3.2-1B-shape bf16 model, decode graphs
  on and off (throughput rows; profiler wall, GPU busy share, launches per step): ``engine_steps.py``.
* ``tier``: the tiered prefix cache on the device, fp32 and int8 KV: a prompt's blocks evicted from the
  pool come back from the host tier and, in a disk-only engine, from the disk tier (on CUDA through the
  side-stream pinned copier), with greedy tokens identical to a recompute; the measured load/recompute
  cost ratio per tier is reported (where it is >= 1, ``--tier-load auto`` recomputes).

Nothing here imports Ray, rich, jinja2 or gguf: the GPU machine has torch, triton, transformers,
safetensors, tokenizers, grpcio and protobuf only.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import random
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvserve.cluster.bench import engine_steps
from kvserve.workers.core.request import WorkerRequest

SMOLLM2_ENV = "KVSERVE_SMOLLM2_DIR"
# NOTE: a small share of the card: enough to prove the sizing path, and a pool of ~10^5 blocks rather
# than the ~10^6 that 0.9 of an H200 holds for a tiny model (a BlockPool is Python: that costs seconds).
SIZING_UTILIZATION = 0.05
# Blocks for the offline rows on CUDA (the standard workloads need ~1300 at block size 16).
OFFLINE_BLOCKS = 16384
WORK_ENV = "KVSERVE_GPU_CHECK_WORK"


@dataclass(frozen=True)
class CheckConfig:
    """Where and how big: ``dry_run`` shrinks every step to seconds on a CPU."""

    device: str
    out: Path
    work: Path
    dry_run: bool

    def __post_init__(self) -> None:
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"device must be cpu or cuda[:N], got {self.device!r}")

    @property
    def on_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def engine_kwargs(self, **overrides: Any) -> dict[str, Any]:
        """Engine arguments for a check: small explicit pools unless a step asks for memory sizing."""
        kw: dict[str, Any] = {"device": self.device, "dtype": "float32", "block_size": 16, "num_gpu_blocks": 512}
        kw.update(overrides)
        return kw


def random_checkpoint(cfg: CheckConfig, arch: str, size: str) -> Path:
    """A random-weight checkpoint (seed 0) under the work folder, written once."""
    from kvserve.workers.models.random_model import init_random

    d = cfg.work / f"{arch}-{size}"
    if not (d / "config.json").is_file():
        init_random(d, arch=arch, size=size, seed=0)
    return d


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of random token ids, lengths uniform in [lo, hi]."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def hf_greedy(model_dir: Path, device: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """HF transformers' greedy continuations (fp32, no EOS stop), one prompt at a time."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(
                torch.tensor([p], device=device),
                attention_mask=torch.ones(1, len(p), dtype=torch.long, device=device),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            outs.append(ids[0, len(p) :].tolist())
    del model
    _free_device_memory()
    return outs


def _greedy(max_tokens: int) -> Any:
    from kvserve.workers.core.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def check_parity(cfg: CheckConfig) -> dict[str, Any]:
    """Engine vs HF greedy fp32 tokens on every checkpoint (see the module docstring)."""
    from kvserve.workers.engine.engine import LLM

    models = {f"{arch}-tiny": random_checkpoint(cfg, arch, "tiny") for arch in ("llama", "qwen2")}
    if not cfg.dry_run:
        models["llama-small"] = random_checkpoint(cfg, "llama", "small")
    smollm2 = os.environ.get(SMOLLM2_ENV)
    if smollm2:
        models["smollm2"] = Path(smollm2)
    n, lo, hi, max_tokens = (3, 4, 20, 4) if cfg.dry_run else (8, 5, 300, 24)
    rows: dict[str, Any] = {}
    pool: dict[str, Any] = {}
    for i, (name, path) in enumerate(models.items()):
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        prompts = random_prompts(n, lo, hi, vocab, seed=i)
        # NOTE: the first engine sizes its pool from gpu_memory_utilization on CUDA (the path a
        # server takes); the others get an explicit pool so that one step never holds two big pools.
        sized = i == 0 and cfg.on_cuda
        kw = (
            cfg.engine_kwargs(num_gpu_blocks=None, gpu_memory_utilization=SIZING_UTILIZATION)
            if sized
            else cfg.engine_kwargs()
        )
        llm = LLM(str(path), **kw)
        t0 = time.perf_counter()
        ours = [o.token_ids for o in llm.generate(prompts, _greedy(max_tokens))]
        seconds = time.perf_counter() - t0
        if i == 0:
            kv = llm.engine.kv_cache
            pool = {
                "sized_by": f"gpu_memory_utilization={SIZING_UTILIZATION}" if sized else "num_gpu_blocks",
                "num_blocks": kv.num_blocks,
                "kv_bytes": sum(t.numel() * t.element_size() for t in kv.layers),
                "kv_device": str(kv.layers[0].device),
                "device_total_bytes": torch.cuda.get_device_properties(cfg.device).total_memory if sized else None,
            }
        del llm
        _free_device_memory()
        theirs = hf_greedy(path, cfg.device, prompts, max_tokens)
        equal = [a == b for a, b in zip(ours, theirs, strict=True)]
        first_diff = next((j for j, ok in enumerate(equal) if not ok), None)
        rows[name] = {
            "requests_equal": sum(equal),
            "requests": len(equal),
            "max_tokens": max_tokens,
            "engine_seconds": round(seconds, 3),
            "first_mismatch": None if first_diff is None else {"ours": ours[first_diff], "hf": theirs[first_diff]},
        }
    total = pool.get("device_total_bytes")
    sized_ok = not total or 0 < pool["kv_bytes"] <= SIZING_UTILIZATION * total
    passed = all(r["requests_equal"] == r["requests"] for r in rows.values()) and pool["num_blocks"] > 0 and sized_ok
    return {
        "passed": passed,
        "models": rows,
        "pool": pool,
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "smollm2": smollm2 or f"not checked (set {SMOLLM2_ENV} to an HF directory)",
    }


def check_kv_smoke(cfg: CheckConfig) -> dict[str, Any]:
    """bf16, fp8-KV and int8-KV runs: complete in-vocabulary outputs; agreement with fp32 reported."""
    from kvserve.cluster.bench.agreement import token_agreement
    from kvserve.workers.engine.engine import LLM

    path = random_checkpoint(cfg, "llama", "tiny")
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    n, lo, hi, max_tokens = (3, 4, 20, 4) if cfg.dry_run else (16, 5, 300, 32)
    prompts = random_prompts(n, lo, hi, vocab, seed=7)
    variants = {
        "fp32": {},
        "bf16": {"dtype": "bfloat16"},
        "fp32+fp8-kv": {"kv_cache_dtype": "fp8"},
        "fp32+int8-kv": {"kv_cache_dtype": "int8"},
    }
    outputs: dict[str, list[list[int]]] = {}
    rows: dict[str, Any] = {}
    for name, extra in variants.items():
        llm = LLM(str(path), **cfg.engine_kwargs(**extra))
        t0 = time.perf_counter()
        outputs[name] = [o.token_ids for o in llm.generate(prompts, _greedy(max_tokens))]
        kv_dtype = str(llm.engine.kv_cache.dtype).removeprefix("torch.")
        del llm
        _free_device_memory()
        complete = all(len(t) == max_tokens and all(0 <= x < vocab for x in t) for t in outputs[name])
        rows[name] = {
            "kv_dtype": kv_dtype,
            "complete": complete,
            "seconds": round(time.perf_counter() - t0, 3),
            "identical_tokens_vs_fp32": token_agreement(outputs[name], outputs["fp32"]),
        }
    return {"passed": all(r["complete"] for r in rows.values()), "runs": rows, "requests": n, "max_tokens": max_tokens}


def check_swap_migration(cfg: CheckConfig) -> dict[str, Any]:
    """Swap preemption and a live export/import on the device keep greedy tokens identical."""
    from kvserve.workers.engine.config import EngineConfig
    from kvserve.workers.engine.engine import LLM, LLMEngine

    path = str(random_checkpoint(cfg, "llama", "tiny"))
    prompts = [list(range(10, 30)), list(range(40, 47)), list(range(50, 66))]
    params = _greedy(16)
    rows: dict[str, Any] = {}
    for kind in ("auto", "int8"):
        common = {"block_size": 4, "kv_cache_dtype": kind}
        expected = [o.token_ids for o in LLM(path, **cfg.engine_kwargs(num_gpu_blocks=256, **common)).generate(
            prompts, params)]  # fmt: skip
        tight = LLM(path, **cfg.engine_kwargs(num_gpu_blocks=14, preemption_mode="swap", swap_space=0.01, **common))
        swapped = [o.token_ids for o in tight.generate(prompts, params, check_integrity=True)]
        swap_pool = tight.engine.swap_pool
        row = {
            "swap_tokens_equal": swapped == expected,
            "swap_preemptions": tight.engine.scheduler.num_preemptions["swap"],
            "swap_blocks_back": swap_pool is not None and swap_pool.num_free_blocks == swap_pool.num_blocks,
            "host_blocks_pinned": tight.engine.kv_cache.swap_layers[0].is_pinned(),
        }
        del tight
        a = LLMEngine(EngineConfig(path, **cfg.engine_kwargs(num_gpu_blocks=64, model_id="m", **common)))
        b = LLMEngine(EngineConfig(path, **cfg.engine_kwargs(num_gpu_blocks=64, model_id="m", **common)))
        a.add_request(WorkerRequest("r", prompts[0], params))
        tokens: list[int] = []
        for _ in range(5):
            tokens += [t for o in a.step() for t in o.new_token_ids]
        state = a.export_request("r")
        exported = state is not None and state.kv_blocks is not None
        row["exported_kv_on_host"] = exported and state.kv_blocks[0].device.type == "cpu"
        row["imported"] = bool(exported and b.import_request(state))
        a.finish_export("r", migrated=row["imported"])
        while b.has_unfinished_requests():
            tokens += [t for o in b.step() for t in o.new_token_ids]
        row["migration_tokens_equal"] = tokens == expected[0]
        row["pools_empty"] = a.pool.stats().used == 0 and b.pool.stats().used == 0
        rows[kind] = row
        del a, b
        _free_device_memory()
    pinned_ok = all(r["host_blocks_pinned"] for r in rows.values()) or not cfg.on_cuda
    passed = pinned_ok and all(
        r["swap_tokens_equal"] and r["swap_preemptions"] > 0 and r["swap_blocks_back"] and r["imported"]
        and r["exported_kv_on_host"] and r["migration_tokens_equal"] and r["pools_empty"]
        for r in rows.values()
    )  # fmt: skip
    return {"passed": passed, "kv": rows}


def check_offline(cfg: CheckConfig) -> dict[str, Any]:
    """``bench offline`` rows through ``cluster.bench.offline.main`` (the JSON it prints, per workload)."""
    from kvserve.cluster.bench import offline

    rows: dict[str, Any] = {}
    workloads = {"tiny": "tiny"} if cfg.dry_run else {"tiny": "tiny", "small": "small"}
    for workload, size in workloads.items():
        argv = ["--model", str(random_checkpoint(cfg, "llama", size)), "--workload", workload, "--json",
                "--device", cfg.device, "--block-size", "16"]  # fmt: skip
        if cfg.dry_run:
            argv += ["--runs", "1", "--num-requests", "4", "--max-tokens", "4", "--kv-cache-memory", "64MiB"]
        else:
            argv += ["--runs", "3", "--num-gpu-blocks", str(OFFLINE_BLOCKS)]
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            status = offline.main(argv)
        rows[workload] = json.loads(buf.getvalue()) if status == 0 else {"exit_status": status}
        _free_device_memory()
    passed = all(r.get("output_tokens_per_s", 0) > 0 for r in rows.values())
    return {"passed": passed, "rows": rows}


def check_tier(cfg: CheckConfig) -> dict[str, Any]:
    """Evict a prompt's blocks, reload them from the host tier and from the disk tier: tokens identical."""
    import shutil

    from kvserve.workers.core.block_hash import cache_extra, hash_blocks
    from kvserve.workers.engine.engine import LLM

    path = random_checkpoint(cfg, "llama", "tiny" if cfg.dry_run else "small")
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    bs, pool_blocks = 4, 16
    (prompt,) = random_prompts(1, 6 * bs, 6 * bs, vocab, seed=11)  # 6 full blocks
    fillers = random_prompts(3, 10 * bs, 10 * bs, vocab, seed=12)  # 3 x 11 blocks: the pool turns over
    params, fill = _greedy(8), _greedy(2)
    rows: dict[str, Any] = {}
    for kv in ("auto", "int8"):
        common = {"block_size": bs, "kv_cache_dtype": kv}
        (expected,) = LLM(str(path), **cfg.engine_kwargs(num_gpu_blocks=128, enable_prefix_caching=False,
                                                         **common)).generate([prompt], params)  # fmt: skip
        _free_device_memory()
        row: dict[str, Any] = {}
        for tier in ("host", "disk"):
            d = cfg.work / f"tier-{kv}-{tier}"
            shutil.rmtree(d, ignore_errors=True)
            where = {"host_cache_memory": "64MiB", "host_cache_dir": str(d)} if tier == "host" else {
                "disk_cache_dir": str(d)}  # fmt: skip
            llm = LLM(str(path), **cfg.engine_kwargs(num_gpu_blocks=pool_blocks, tier_load="always", **where, **common))
            engine = llm.engine
            assert engine.tiers is not None
            (first,) = llm.generate([prompt], params)
            llm.generate(fillers, fill)
            hashes = hash_blocks(prompt, bs, cache_extra(engine.model_id, None))
            evicted = all(engine.pool.cached_block(h) is None for h in hashes)
            engine.tiers.flush()
            (again,) = llm.generate([prompt], params, check_integrity=True)
            c = engine.tier_cost
            load = c.load_s_per_block.get(tier)
            row[tier] = {
                "copier": type(engine.tiers.copier).__name__,
                "evicted_from_pool": evicted,
                "loaded_tokens": engine.scheduler.tier_hits[tier],
                "prompt_tokens": len(prompt),
                "tokens_equal": first.token_ids == expected.token_ids and again.token_ids == expected.token_ids,
                "load_ms_per_block": None if load is None else round(1e3 * load, 4),
                "recompute_ms_per_block": round(1e3 * (c.recompute_s_per_block() or 0.0), 4),
                "load_recompute_ratio": c.ratio(tier),
                "auto_would_load": c.load_pays(tier),
            }
            engine.close()
            del llm, engine
            _free_device_memory()
            shutil.rmtree(d, ignore_errors=True)
        rows[kv] = row
    want_copier = "CudaTierCopier" if cfg.on_cuda else "TierCopier"
    passed = all(
        r["evicted_from_pool"] and r["tokens_equal"] and r["loaded_tokens"] == r["prompt_tokens"]
        and r["copier"] == want_copier and r["load_recompute_ratio"] is not None
        for row in rows.values() for r in row.values()
    )  # fmt: skip
    return {"passed": passed, "kv": rows, "block_size": bs}


STEPS: dict[str, Callable[[CheckConfig], dict[str, Any]]] = {
    "parity": check_parity,
    "kv_smoke": check_kv_smoke,
    "swap_migration": check_swap_migration,
    "offline": check_offline,
    "tier": check_tier,
}

# The engine-speed steps (decode graphs on/off, profiler figures) live in engine_steps.py.
STEPS.update(engine_1b=engine_steps.check_engine_1b, decode_profile=engine_steps.check_decode_profile)


def run_step(name: str, cfg: CheckConfig) -> bool:
    """Run one step, write ``OUT/NAME.json`` (a crash is recorded as a failed step), return passed."""
    t0 = time.perf_counter()
    try:
        result = STEPS[name](cfg)
    except Exception:  # noqa: BLE001 - any failure is this step's result; the script goes on to the next
        result = {"passed": False, "error": traceback.format_exc()}
    result = {"step": name, "device": cfg.device, "dry_run": cfg.dry_run,
              "seconds": round(time.perf_counter() - t0, 2), **result}  # fmt: skip
    cfg.out.mkdir(parents=True, exist_ok=True)
    (cfg.out / f"{name}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "error"})[:2000])
    if "error" in result:
        print(result["error"], file=sys.stderr)
    return bool(result["passed"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvserve.cluster.bench.gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("step", choices=sorted(STEPS))
    p.add_argument("--device", default="cuda", help="cuda[:N] | cpu")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for STEP.json (default: $OUT)")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes (seconds on a CPU)")
    args = p.parse_args(argv)
    work = Path(os.environ.get(WORK_ENV) or Path(os.environ.get("TMPDIR", "/tmp")) / "kvserve-gpu-check")
    cfg = CheckConfig(device=args.device, out=Path(args.out), work=work, dry_run=args.dry_run)
    if cfg.on_cuda and not torch.cuda.is_available():
        print(f"gpu_check: --device {cfg.device} but torch sees no CUDA device", file=sys.stderr)
        return 2
    return 0 if run_step(args.step, cfg) else 1


if __name__ == "__main__":
    sys.exit(main())
