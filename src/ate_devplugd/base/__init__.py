"""Foundations: files replaced in one step, back-offs, inotify, logging, unix sockets and their gRPC server.

Nothing here knows of devices, kubelet or the configuration; every other package may use these modules.
"""
