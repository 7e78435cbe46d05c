"""The engine-speed steps of ``gpu_check``: ``engine_1b`` and ``decode_profile``.

* ``engine_1b``: a random-weight Llama of Llama-3.2-1B's shape (hidden 2048, intermediate 8192, 16 layers,
  32/8 heads, vocab 32000), bf16, block 16, weights drawn on the device. Rows: decode-heavy (256 requests,
  prompts 32-64 tokens, 512 out) and mixed (512 requests, 128-1024 in, 256 out), each with decode graphs
  on and off (``enforce_eager``) and on with overlapped scheduling (``async_scheduling``); output and total
  tokens/s, and whether the runs' tokens agree.
* ``decode_profile``: ``torch.profiler`` over decode steps at batch 1, 32 and 256 (contexts 200-400),
  graphs on and off: wall per step, the GPU's busy share of it (kernel time / wall) and kernel launches
  per step (runtime + driver launches and graph launches).

``--dry-run`` runs both on CPU with the tiny random Llama and small batches (graphs "on" is the eager
twin of ``cuda_graphs``): the same code, no timing claims; busy share and launches are CUDA-only (null).
"""

from __future__ import annotations

import gc
import json
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from kvserve.workers.engine.engine import LLM


class CheckConfig(Protocol):
    """What these steps use of gpu_check.py's ``CheckConfig`` (a contract, so neither module imports the other
    at file level)."""

    device: str
    work: Path
    dry_run: bool

    @property
    def on_cuda(self) -> bool: ...

    def engine_kwargs(self, **overrides: Any) -> dict[str, Any]: ...

# Llama-3.2-1B's shape (vocab 32000 as the issue's measurements; random weights).
SHAPE_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8)  # fmt: skip
LAUNCH_EVENTS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")
PROFILE_STEPS = 10


def _prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab - 2) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def write_1b_checkpoint(cfg: CheckConfig) -> Path:
    """The 1B-shape checkpoint (bf16, N(0, 0.02) weights drawn on the check's device), written once."""
    from safetensors.torch import save_file

    from kvserve.workers.models.random_model import ModelSize, model_config, write_tokenizer

    d = cfg.work / "llama-1b-shape"
    if (d / "model.safetensors").is_file():
        return d
    d.mkdir(parents=True, exist_ok=True)
    shape = ModelSize(**SHAPE_1B)
    config = model_config("llama", shape, "bfloat16")
    h, inter, vocab = shape.hidden_size, shape.intermediate_size, config["vocab_size"]
    hd = config["head_dim"]
    q, kv = shape.num_attention_heads * hd, shape.num_key_value_heads * hd
    g = torch.Generator(cfg.device).manual_seed(0)

    def normal(*dims: int) -> torch.Tensor:
        return torch.empty(dims, device=cfg.device).normal_(0.0, 0.02, generator=g).to(torch.bfloat16).cpu()

    ones = torch.ones(h, dtype=torch.bfloat16)
    w = {"model.embed_tokens.weight": normal(vocab, h), "model.norm.weight": ones, "lm_head.weight": normal(vocab, h)}
    for i in range(shape.num_hidden_layers):
        p = f"model.layers.{i}."
        w |= {p + "self_attn.q_proj.weight": normal(q, h), p + "self_attn.k_proj.weight": normal(kv, h),
              p + "self_attn.v_proj.weight": normal(kv, h), p + "self_attn.o_proj.weight": normal(h, q),
              p + "mlp.gate_proj.weight": normal(inter, h), p + "mlp.up_proj.weight": normal(inter, h),
              p + "mlp.down_proj.weight": normal(h, inter), p + "input_layernorm.weight": ones,
              p + "post_attention_layernorm.weight": ones}  # fmt: skip
    (d / "config.json").write_text(json.dumps(config))
    write_tokenizer(d)
    save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


def _model(cfg: CheckConfig) -> tuple[Path, str]:
    """The checkpoint and dtype of these steps: the 1B shape in bf16 on CUDA, the tiny Llama in fp32 dry."""
    from kvserve.cluster.bench.gpu_check import random_checkpoint

    if cfg.dry_run:
        return random_checkpoint(cfg, "llama", "tiny"), "float32"
    return write_1b_checkpoint(cfg), "bfloat16"


def _engine(cfg: CheckConfig, path: Path, dtype: str, graphs: bool, **kw: Any) -> LLM:
    """An engine with decode graphs on or off (on CPU, "on" installs the graphs' eager twin)."""
    from kvserve.workers.engine.engine import LLM

    llm = LLM(str(path), **cfg.engine_kwargs(dtype=dtype, enforce_eager=not graphs, **kw))
    if graphs and not cfg.on_cuda:
        llm.engine.enable_decode_graphs()
    return llm


def _release(llm: LLM) -> None:
    llm.engine.close()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _sync(cfg: CheckConfig) -> None:
    if cfg.on_cuda:
        torch.cuda.synchronize(cfg.device)


def check_engine_1b(cfg: CheckConfig) -> dict[str, Any]:
    """Decode-heavy and mixed throughput, decode graphs on and off; tokens of the two runs compared."""
    from kvserve.workers.core.sampling_params import SamplingParams

    path, dtype = _model(cfg)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    scale = 16 if cfg.dry_run else 1  # dry: 16 requests of 32 out, etc.
    workloads = {
        "decode_heavy": (_prompts(256 // scale, 32, 64, vocab, seed=1), 512 // scale),
        "mixed": (_prompts(512 // scale, 128 // scale, 1024 // scale, vocab, seed=2), 256 // scale),
    }
    blocks = 48_000 if not cfg.dry_run else 2048
    rows: dict[str, Any] = {}
    for name, (prompts, out_len) in workloads.items():
        params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
        tokens = {}
        # graphs on, off, and on with overlapped scheduling (async_scheduling: the host schedules the next
        # step while the device runs this one)
        for graphs, overlap in ((True, False), (False, False), (True, True)):
            llm = _engine(cfg, path, dtype, graphs, num_gpu_blocks=blocks, max_num_seqs=256,
                          async_scheduling=overlap)  # fmt: skip
            llm.generate(prompts[:8], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
            _sync(cfg)
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            _sync(cfg)
            seconds = time.perf_counter() - t0
            num_out = sum(len(o.token_ids) for o in outs)
            num_in = sum(map(len, prompts))
            graph_set = llm.engine.runner.decode_graphs
            rows[f"{name}/graphs_{'on' if graphs else 'off'}{'_async' if overlap else ''}"] = {
                "requests": len(prompts),
                "output_tokens_per_s": round(num_out / seconds, 1),
                "total_tokens_per_s": round((num_out + num_in) / seconds, 1),
                "seconds": round(seconds, 3),
                "graph_steps": graph_set.replays if graph_set is not None else 0,
            }
            tokens[graphs, overlap] = [o.token_ids for o in outs]
            _release(llm)
        same = sum(a == b for a, b in zip(tokens[True, False], tokens[False, False], strict=True))
        rows[f"{name}/graphs_on_off_identical_requests"] = f"{same}/{len(prompts)}"
        same = sum(a == b for a, b in zip(tokens[True, False], tokens[True, True], strict=True))
        rows[f"{name}/async_on_off_identical_requests"] = f"{same}/{len(prompts)}"
    graph_rows = [r for k, r in rows.items() if k.endswith(("graphs_on", "graphs_on_async")) and isinstance(r, dict)]
    passed = all(r["graph_steps"] > 0 for r in graph_rows)
    return {"passed": passed, "model": "llama-3.2-1b-shape" if not cfg.dry_run else "llama-tiny", "dtype": dtype,
            "block_size": 16, "rows": rows}  # fmt: skip


def _profile_steps(cfg: CheckConfig, llm: LLM, steps: int) -> dict[str, Any]:
    """``steps`` engine steps under torch.profiler: wall per step, GPU busy share, launches per step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cfg.on_cuda else [])
    _sync(cfg)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            llm.engine.step()
        _sync(cfg)
        wall = time.perf_counter() - t0
    events = prof.events()
    row: dict[str, Any] = {"wall_ms_per_step": round(1e3 * wall / steps, 3)}
    row["aten_ops_per_step"] = round(sum(e.name.startswith("aten::") for e in events) / steps, 1)
    if cfg.on_cuda:
        kernel_us = sum(e.time_range.elapsed_us() for e in events if e.device_type == DeviceType.CUDA)
        row["gpu_ms_per_step"] = round(kernel_us / 1e3 / steps, 3)
        row["gpu_busy_share"] = round(kernel_us / 1e6 / wall, 3)
        row["launches_per_step"] = round(sum(e.name in LAUNCH_EVENTS for e in events) / steps, 1)
        row["graph_launches_per_step"] = round(sum(e.name == "cudaGraphLaunch" for e in events) / steps, 1)
    else:
        row |= {"gpu_ms_per_step": None, "gpu_busy_share": None, "launches_per_step": None}
    return row


def check_decode_profile(cfg: CheckConfig) -> dict[str, Any]:
    """Decode steps at batch 1, 32 and 256 (contexts 200-400), graphs on and off, under torch.profiler."""
    from kvserve.workers.core.request import WorkerRequest
    from kvserve.workers.core.sampling_params import SamplingParams

    path, dtype = _model(cfg)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    batches, lo, hi = ((1, 2, 4), 20, 40) if cfg.dry_run else ((1, 32, 256), 200, 400)
    steps = 3 if cfg.dry_run else PROFILE_STEPS
    rows: dict[str, Any] = {}
    for graphs in (True, False):
        llm = _engine(cfg, path, dtype, graphs, num_gpu_blocks=256 * 32, max_num_seqs=max(batches))
        engine = llm.engine
        for batch in batches:
            params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
            for i, p in enumerate(_prompts(batch, lo, hi, vocab, seed=batch)):
                engine.add_request(WorkerRequest(f"b{batch}-{i}", p, params))
            # Prefill everything, then three warm decode steps, then the profiled ones.
            while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
                engine.step()
            for _ in range(3):
                engine.step()
            rows[f"batch_{batch}/graphs_{'on' if graphs else 'off'}"] = _profile_steps(cfg, llm, steps)
            while engine.has_unfinished_requests():
                engine.step()
        _release(llm)
    return {"passed": True, "steps_profiled": steps, "dtype": dtype, "rows": rows}
