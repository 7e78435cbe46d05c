"""Decisions: placement (filters, scorers, pickers), admission, rebalancing, service times, prefix index."""
