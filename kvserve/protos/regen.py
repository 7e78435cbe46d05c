"""Regenerate the Python code for ``kvserve/protos/kvserve/v1/*.proto`` with grpc_tools.protoc.

Usage (from anywhere)::

    python kvserve/protos/regen.py            # rewrite the checked-in files next to the .proto files
    python kvserve/protos/regen.py OUT_DIR    # write OUT_DIR/kvserve/v1/... instead (used by the freshness test)

Writes ``*_pb2.py``, ``*_pb2.pyi`` (stubs headed ``# ruff: noqa``) and ``*_pb2_grpc.py``.
protoc is run with ``-I protos`` so the descriptor file names are the canonical
``kvserve/v1/*.proto``; its generated cross-imports (``from kvserve.v1 import x_pb2``) are then
rewritten to ``from kvserve.protos.kvserve.v1 import x_pb2`` so the modules import with the repo root on
``sys.path`` and when installed as package ``kvserve.protos``.

NOTE: the output depends on the grpcio-tools version (it stamps the protobuf/grpc versions it
was made with); regenerate after upgrading it, and the freshness test will say when to.
"""

from __future__ import annotations

import re
import sys
import tempfile
from importlib import resources
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PACKAGE_DIR = Path("kvserve") / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")

_IMPORT_FIX = re.compile(r"^(from|import) kvserve\.v1\b", re.MULTILINE)


def proto_files() -> list[Path]:
    """The .proto files to compile, relative to ``PROTO_ROOT``, sorted."""
    return sorted(p.relative_to(PROTO_ROOT) for p in (PROTO_ROOT / PACKAGE_DIR).glob("*.proto"))


def generated_files(root: Path) -> list[Path]:
    """Generated files under ``root/kvserve/v1`` (absolute paths, sorted)."""
    return sorted(p for p in (root / PACKAGE_DIR).iterdir() if p.name.endswith(GENERATED_SUFFIXES))


# NOTE: pyproject's ruff exclude names only *_pb2*.py; the stubs opt out of linting themselves.
_STUB_HEADER = "# ruff: noqa\n"


def _fix_imports(text: str) -> str:
    return _IMPORT_FIX.sub(lambda m: f"{m.group(1)} kvserve.protos.kvserve.v1", text)


def _postprocess(name: str, text: str) -> str:
    text = _fix_imports(text)
    if name.endswith(".pyi"):
        text = _STUB_HEADER + text
    return text


def generate(out_root: Path) -> list[Path]:
    """Compile every proto into ``out_root/kvserve/v1/`` and fix its import lines.

    Args:
        out_root: directory that plays the role of ``protos/``; created if missing.

    Returns:
        The generated files, sorted.

    Raises:
        RuntimeError: protoc failed (its message is on stderr).
    """
    from grpc_tools import protoc  # dev dependency; imported here so the module loads without it

    out_root = Path(out_root)
    with tempfile.TemporaryDirectory() as tmp:
        include = str(resources.files("grpc_tools") / "_proto")
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *(str(p) for p in proto_files()),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        (out_root / PACKAGE_DIR).mkdir(parents=True, exist_ok=True)
        written = []
        for src in generated_files(Path(tmp)):
            dst = out_root / PACKAGE_DIR / src.name
            dst.write_text(_postprocess(src.name, src.read_text()))
            written.append(dst)
    return sorted(written)


def main(argv: list[str]) -> int:
    out_root = Path(argv[0]) if argv else PROTO_ROOT
    if out_root.resolve() == PROTO_ROOT:
        for stale in generated_files(PROTO_ROOT):  # a deleted .proto leaves no orphan modules
            stale.unlink()
    for path in generate(out_root):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
