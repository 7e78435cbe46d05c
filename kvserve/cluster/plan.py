"""``kvserve plan``: what a model's KV cache costs, and how many users fit a card.

KV bytes per token = 2 (K and V) x layers x KV heads x head dim x bytes per element (int8 adds an fp32
scale per token and KV head); a request holds that times its context, in whole blocks. Weights are
counted from the architecture.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from kvserve.workers.core.sizes import SCALE_BYTES, blocks_for, parse_bytes

KV_DTYPE_BYTES = {"fp32": 4, "float32": 4, "fp16": 2, "float16": 2, "bf16": 2, "bfloat16": 2, "fp8": 1, "int8": 1}


@dataclass(frozen=True)
class Shape:
    """What KV and weight sizes depend on."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_heads: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    weight_bytes_per_param: int = 2

    @property
    def num_params(self) -> int:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * per_layer + h + head

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> Shape:
        from kvserve.workers.models.model_config import ModelConfig

        c = ModelConfig.from_dir(model_dir)
        elem = {4: 4, 2: 2}.get(c.dtype.itemsize, 2)
        return cls(
            name=str(model_dir), num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
            num_heads=c.num_heads, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
            vocab_size=c.vocab_size, tie_word_embeddings=c.tie_word_embeddings, weight_bytes_per_param=elem,
        )  # fmt: skip


# Well-known shapes (from their config.json files), weights in bf16.
PRESETS: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape("llama-3-8b", 32, 8, 128, 32, 4096, 14336, 128256),
        Shape("llama-3-70b", 80, 8, 128, 64, 8192, 28672, 128256),
        Shape("llama-2-7b", 32, 32, 128, 32, 4096, 11008, 32000),
        Shape("mistral-7b", 32, 8, 128, 32, 4096, 14336, 32000),
        Shape("qwen2-7b", 28, 4, 128, 28, 3584, 18944, 152064),
        Shape("kvserve-tiny", 4, 2, 32, 8, 256, 688, 32000, weight_bytes_per_param=4),
        Shape("kvserve-small", 12, 4, 64, 12, 768, 2048, 32000, weight_bytes_per_param=4),
    )
}


def kv_bytes_per_token(shape: Shape, kv_dtype: str) -> int:
    """2 x layers x KV heads x (head dim x element bytes, + an fp32 scale per row for int8)."""
    row = shape.head_dim * KV_DTYPE_BYTES[kv_dtype] + (SCALE_BYTES if kv_dtype == "int8" else 0)
    return 2 * shape.num_layers * shape.num_kv_heads * row


@dataclass(frozen=True)
class PlanRow:
    kv_dtype: str
    users: int
    context: int
    kv_bytes_per_token: int
    kv_bytes_per_request: int  # whole blocks
    kv_bytes_total: int
    weight_bytes: int
    fits: bool
    max_users: int  # at this context, after weights
    blocks_per_request: int
    total_blocks: int  # blocks the memory left after weights holds


def plan(shape: Shape, context: int, users: int, kv_dtype: str, memory_bytes: int, block_size: int = 16) -> PlanRow:
    """One row: ``users`` requests of ``context`` tokens in ``memory_bytes`` (weights included)."""
    if kv_dtype not in KV_DTYPE_BYTES:
        raise ValueError(f"unknown KV dtype {kv_dtype!r}; choose from {sorted(KV_DTYPE_BYTES)}")
    if context <= 0 or users < 0 or block_size <= 0:
        raise ValueError("context and block_size must be positive, users >= 0")
    per_token = kv_bytes_per_token(shape, kv_dtype)
    per_block = per_token * block_size
    blocks_per_request = blocks_for(context, block_size)
    per_request = blocks_per_request * per_block
    weights = shape.num_params * shape.weight_bytes_per_param
    room = max(memory_bytes - weights, 0)
    total_blocks = room // per_block
    return PlanRow(
        kv_dtype=kv_dtype, users=users, context=context, kv_bytes_per_token=per_token,
        kv_bytes_per_request=per_request, kv_bytes_total=per_request * users, weight_bytes=weights,
        fits=weights + per_request * users <= memory_bytes, max_users=total_blocks // blocks_per_request,
        blocks_per_request=blocks_per_request, total_blocks=total_blocks,
    )  # fmt: skip


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def cmd_plan(args: argparse.Namespace) -> int:
    if bool(args.model) == bool(args.preset):
        print("error: give exactly one of --model DIR or --preset NAME", file=sys.stderr)
        return 2
    if args.preset and args.preset not in PRESETS:
        print(f"error: unknown preset {args.preset!r}; choose from {sorted(PRESETS)}", file=sys.stderr)
        return 2
    shape = PRESETS[args.preset] if args.preset else Shape.from_model_dir(args.model)
    memory = parse_bytes(args.gpu_memory)
    users = [int(u) for u in args.users.split(",")]
    dtypes = args.kv_cache_dtype.split(",")
    try:
        rows = [plan(shape, args.context, u, d, memory, args.block_size) for d in dtypes for u in users]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"model": shape.name, "params": shape.num_params, "rows": [asdict(r) for r in rows]}))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(
        f"[bold]{shape.name}[/]: {shape.num_layers} layers, {shape.num_kv_heads} KV heads x {shape.head_dim}, "
        f"{shape.num_params / 1e9:.2f}B params; context {args.context}, memory {_gib(memory)}, "
        f"block size {args.block_size}"
    )
    for dtype in dtypes:
        table = Table(title=f"KV dtype {dtype}")
        for col in ("users", "KV/token", "KV/request", "KV total", "weights", "fits", "max users", "blocks"):
            table.add_column(col, justify="right")
        for r in rows:
            if r.kv_dtype != dtype:
                continue
            table.add_row(
                str(r.users), f"{r.kv_bytes_per_token / 1024:.1f} KiB", _gib(r.kv_bytes_per_request),
                _gib(r.kv_bytes_total), _gib(r.weight_bytes), "yes" if r.fits else "[red]no[/]",
                str(r.max_users), f"{r.blocks_per_request}/req of {r.total_blocks}",
            )  # fmt: skip
        console.print(table)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="KV memory per token/request/users, and how many users fit")
    p.add_argument("--model", help="HF model directory (reads config.json)")
    p.add_argument("--preset", help=f"a well-known shape: {', '.join(sorted(PRESETS))}")
    p.add_argument("--context", type=int, default=8192, help="tokens per request (prompt + output)")
    p.add_argument("--users", default="1,32", help="comma-separated concurrent users")
    p.add_argument("--kv-cache-dtype", default="fp16,fp8", help="comma-separated: fp32, fp16, bf16, fp8, int8")
    p.add_argument("--gpu-memory", default="80GiB", help="memory for weights + KV, e.g. 80GiB")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)
