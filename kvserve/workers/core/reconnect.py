"""How fast the cluster's own gRPC links (worker -> router, worker -> frontend, frontend -> router) reach a peer
that restarted on the same port.

gRPC's own reconnect backoff starts at 1 s and grows to 120 s: a restarted router would be reached seconds
after it listens. These links retry a refused connect within 0.1-0.5 s (a connect on loopback or a cluster
network costs microseconds; the links are a handful per process).
"""

RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
)
