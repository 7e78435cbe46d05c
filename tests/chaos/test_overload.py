"""Overload on a real ``kvserve serve`` (tiny model, 2 CPU workers of 64 blocks): a burst of long
generations (100-token prompts, 900 tokens: one request per worker at its longest) under a short
deadline (issue 41 item 4).

* No request is admitted that never gets a token: what cannot start by its deadline is refused at
  once (kvserve/router/policy/admission.py, the decode work ahead), not queued to expire.
* Every refusal carries ``retry-after-ms`` (``max_streams_per_client``'s too: tests/unit/test_limit_retry_hints.py;
  one client's burst cannot meet both bounds, the per-client one counting only admitted streams).
* No stream ends CANCELLED (no client cancels), and the router log has no traceback (calls that
  expire mid-stream or while their answer is on its way end quietly).
Ends with the cluster idle: all blocks free, every pool's integrity intact.
"""

from __future__ import annotations

import grpc

from tests.chaos.conftest import ServedCluster
from tests.chaos.served import cluster_fixture
from tests.chaos.streams import Stream, prompt, request, run_all

PROMPT_TOKENS = 100
MAX_TOKENS = 900  # 1000 tokens = 63 blocks of 16: one such request fits a 64-block pool at its longest
DEADLINE_S = 10.0
BURST = 40


cluster = cluster_fixture()


def test_a_burst_that_cannot_start_in_time_is_refused_with_retry_hints_not_queued_to_expire(
    cluster: ServedCluster,
) -> None:
    c = cluster
    # Steps measured (short probes that run to their max_tokens: they do not cap the estimate).
    warm = run_all(c.address, [request(prompt(i, PROMPT_TOKENS), 8) for i in range(4)])
    assert all(s.code == grpc.StatusCode.OK for s in warm), [(s.code, s.details) for s in warm]
    c.wait_idle()

    streams = [Stream(c.address, request(prompt(100 + i, PROMPT_TOKENS), MAX_TOKENS), timeout=DEADLINE_S,
                      first_tokens=1).start() for i in range(BURST)]  # fmt: skip
    for s in streams:
        s.wait(DEADLINE_S + 120)
    refused = [s for s in streams if s.code == grpc.StatusCode.RESOURCE_EXHAUSTED]
    admitted = [s for s in streams if s not in refused]
    never_started = [s for s in admitted if not s.tokens]

    assert not never_started, [(s.code, s.details) for s in never_started]
    unhinted = [(s.details, s.trailers) for s in refused if not s.trailers.get("retry-after-ms", "").isdigit()]
    assert not unhinted and all(int(s.trailers["retry-after-ms"]) > 0 for s in refused), unhinted
    assert refused, "the burst must overload the cluster for this test to mean anything"
    assert not [s for s in streams if s.code == grpc.StatusCode.CANCELLED], "CANCELLED without a client cancel"
    assert all(s.code in (grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED) for s in admitted), [
        (s.code, s.details) for s in admitted
    ]
    c.wait_idle(120)
    log = c.proc.out + c.proc.err
    assert "Traceback" not in log, log[log.index("Traceback") - 2000 : log.index("Traceback") + 3000]
    print(f"\nFIGURES overload: burst {BURST} x ({PROMPT_TOKENS} + {MAX_TOKENS} tokens), deadline {DEADLINE_S}s, "
          f"2 workers x 64 blocks: admitted {len(admitted)} (never started 0; "
          f"{sum(s.code == grpc.StatusCode.DEADLINE_EXCEEDED for s in admitted)} ended by their deadline "
          f"mid-stream), refused {len(refused)} (hints {sorted(int(s.trailers['retry-after-ms']) for s in refused)} "
          "ms); tracebacks 0")  # fmt: skip
