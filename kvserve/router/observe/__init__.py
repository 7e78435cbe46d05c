"""What the router exports about itself: Prometheus metrics, loop lag, the status table."""
