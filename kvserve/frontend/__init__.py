"""Stateless frontends: the client APIs in processes of their own, relayed to the router (frontend/server.py)."""
