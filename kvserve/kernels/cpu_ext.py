"""Build and load kvserve's C++ CPU kernels (``kvserve/kernels/csrc/cpu_ops.cpp``, ops ``torch.ops.kvserve_cpu``).

``python -m kvserve.kernels.cpu_ext`` (run by ``make setup``) compiles the ops once per machine with the C++
compiler and torch's headers into ``$KVSERVE_EXT_DIR`` (default ``<sys.prefix>/share/kvserve``), named by
a hash of the source, the flags and the torch version, so a stale build is never loaded. The engine
only loads a finished build (``available()``); where there is none, no compiler, a CPU without AVX2 +
FMA, or ``KVSERVE_CPU_EXT=0``, the CPU backend runs the plain-torch reference instead (same results,
slower), and says why once in the log.

NOTE: compiled with g++ directly rather than ``torch.utils.cpp_extension.load``, which needs ninja on
PATH; ``include_paths``/``library_paths`` from the same module keep the flags torch's own.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from functools import cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.cpp"
_X86 = platform.machine().lower() in ("x86_64", "amd64")
# NOTE: AVX2 + FMA is the floor every x86 CPU of the last decade meets; the loops are memory-bound,
# so AVX-512 would buy little and would tie the build to one ISA (builds are per machine, not per CPU
# model: a venv may move between cloud VM generations).
FLAGS = ["-O3", "-std=c++20", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off", "-DNDEBUG"]
ISA_FLAGS = ["-mavx2", "-mfma"] if _X86 else []


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def _command(compiler: str, out: Path) -> list[str]:
    from torch.utils import cpp_extension

    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", 1))
    cmd = [compiler, *FLAGS, *ISA_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    cmd += [f"-I{p}" for p in cpp_extension.include_paths()]
    cmd += [str(SOURCE), "-o", str(out)]
    for lib_dir in cpp_extension.library_paths():
        cmd += [f"-L{lib_dir}", f"-Wl,-rpath,{lib_dir}"]
    return [*cmd, "-lc10", "-ltorch_cpu"]


def library_path() -> Path:
    """Where the build for this source, these flags and this torch lives (it may not exist)."""
    digest = hashlib.sha256()
    digest.update(SOURCE.read_bytes())
    digest.update(" ".join(FLAGS + ISA_FLAGS).encode())
    digest.update(torch.__version__.encode())
    root = Path(os.environ.get("KVSERVE_EXT_DIR") or Path(sys.prefix) / "share" / "kvserve")
    return root / f"kvserve_cpu_{digest.hexdigest()[:16]}.so"


def build(verbose: bool = False) -> Path:
    """Compile the ops if this build is not there yet; returns the library's path. Raises on failure."""
    out = library_path()
    if out.exists():
        return out
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler (set CXX, or install g++)")
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent builds (several workers) never see half a file.
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        partial = Path(tmp) / out.name
        cmd = _command(compiler, partial)
        if verbose:
            print(" ".join(cmd), file=sys.stderr)
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"building {SOURCE.name} failed:\n{done.stderr[-4000:]}")
        os.replace(partial, out)
    return out


def unusable_reason() -> str | None:
    """Why the ops cannot run in this process, or None."""
    if os.environ.get("KVSERVE_CPU_EXT", "1").strip().lower() in ("0", "false", "off", "no"):
        return "disabled by KVSERVE_CPU_EXT=0"
    if _X86 and torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"the CPU (or ATEN_CPU_CAPABILITY) offers {torch.backends.cpu.get_cpu_capability()}, not AVX2 + FMA"
    path = library_path()
    if not path.exists():
        return f"no build for this source and torch at {path} (run `make setup`)"
    return None


@cache
def available() -> bool:
    """Whether ``torch.ops.kvserve_cpu`` is loaded (loading it on the first call)."""
    reason = unusable_reason()
    if reason is None:
        try:
            torch.ops.load_library(str(library_path()))
            return True
        except OSError as e:
            reason = f"failed to load: {e}"
    logger.info("C++ CPU kernels not used (%s): the plain-torch path runs instead", reason)
    return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvserve.kernels.cpu_ext", description=__doc__.split("\n\n")[0])
    p.add_argument("--verbose", action="store_true", help="print the compiler command")
    args = p.parse_args(argv)
    start = time.perf_counter()
    try:
        path = build(verbose=args.verbose)
    except (RuntimeError, OSError) as e:
        # NOTE: not fatal for setup: the engine runs the plain-torch kernels without the build.
        print(f"warning: C++ CPU kernels not built ({e}); the engine will use the plain-torch path", file=sys.stderr)
        return 0
    print(f"C++ CPU kernels: {path} ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
