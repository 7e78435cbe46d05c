"""kvserve: a Ray-based LLM serving cluster around a paged KV cache.

Every part lives under this one namespace (``kvserve.cluster``, ``kvserve.frontend``, ``kvserve.router``,
``kvserve.workers``, ``kvserve.kernels``, ``kvserve.protos``) so that no dependency's top-level package
(Hugging Face's ``kernels`` was one) can shadow it.
"""
