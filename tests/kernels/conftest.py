"""Kernel tests: without CUDA, Triton kernels run under the interpreter (fp32/fp16 only).

NOTE: ``TRITON_INTERPRET`` must be set before ``kernels.attention`` / ``kernels.cache_ops`` are imported
(``triton.jit`` picks interpreter vs compiler at decoration time), so it is set here, at import.
"""

from __future__ import annotations

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    # NOTE: the prefill kernel's untuned default on a GPU: autotuning every test shape would spend the
    # device minutes on tuning runs; test_prefill_flash.py's autotuned test turns it back on for itself.
    os.environ.setdefault("KVSERVE_PREFILL_AUTOTUNE", "0")
