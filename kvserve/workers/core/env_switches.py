"""kvserve's on/off environment switches, each on unless set to ``0`` (documented in the README). A leaf
(no torch): the router and the workers' host tuning read them alike.

- ``KVSERVE_THREAD_GOVERNOR``, ``KVSERVE_ONEDNN``, ``KVSERVE_GREEDY_SCREEN``: a worker's host tuning
  (``kvserve/workers/host/host_tuning.py``).
- ``KVSERVE_GC_FREEZE``: long-lived processes freeze their start-up heap (``kvserve/workers/core/gc_pauses.py``).
"""

from __future__ import annotations

import os

ENV_SWITCHES = ("KVSERVE_THREAD_GOVERNOR", "KVSERVE_ONEDNN", "KVSERVE_GREEDY_SCREEN", "KVSERVE_GC_FREEZE")


def env_switch(name: str) -> bool:
    """Whether the switch ``name`` (one of ``ENV_SWITCHES``) is on: unset or anything but ``0``.

    Raises:
        ValueError: ``name`` is not a known switch (a typo would otherwise read as "on").
    """
    if name not in ENV_SWITCHES:
        raise ValueError(f"unknown switch {name!r}; known: {ENV_SWITCHES}")
    return os.environ.get(name, "1") != "0"
