"""The daemon (placeholder docstring; rewritten by the service split)."""
