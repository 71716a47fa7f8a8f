"""Operator tools (placeholder docstring; rewritten by the ops split)."""
