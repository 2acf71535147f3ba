"""Reloading the configuration: whether a re-read config may be applied, how each reload went, and the
record the running daemon announces of itself (what the commands read of it)."""
