"""One local Ray cluster per test session (starting Ray costs ~5 s), shared by every integration test.

Tests start the routers/workers they need on it and stop them; traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    import ray

    if ray.is_initialized():
        # NOTE: something earlier in this process started a Ray of its own (Ray starts one with the
        # machine's 2 CPUs on the first API call it sees): our clusters need the resources below.
        ray.shutdown()
    if not ray.is_initialized():
        # NOTE: more logical CPUs than cores: workers are mostly idle in tests, and two workers
        # plus a router must fit beside each other on a 2-core machine.
        ray.init(
            # NOTE: "local" always starts a fresh cluster; a bare init would join whatever cluster
            # `ray start` last recorded on this machine (and then refuse num_cpus).
            address="local",
            num_cpus=8,
            include_dashboard=False,
            logging_level=logging.WARNING,
            log_to_driver=False,
            runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
        )
    yield
    ray.shutdown()
