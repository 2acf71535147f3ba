"""Reloading the configuration: whether a re-read config may be applied, how each reload went, and the
runtime directory where the running daemon keeps its running config and its last reload's outcome.
"""
