"""Prometheus metrics of the OpenAI-compatible HTTP API (``kvserve/router/api/http_api.py``), beside the gRPC ones.

Same registry and ``kvserve:`` prefix as the rest. ``route`` is the route template (a fixed set,
``other`` for anything else), so the label's cardinality stays bounded whatever clients send.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

HTTP_REQUESTS = Counter("kvserve:http_requests", "HTTP API requests by route and status code", ["route", "status"])
HTTP_DURATION = Histogram(
    "kvserve:http_request_duration_seconds",
    "HTTP API request time, first byte in to last byte out (streams: the whole stream)",
    ["route"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)
