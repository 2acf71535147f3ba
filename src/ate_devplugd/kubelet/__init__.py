"""kubelet as a node service shows itself to us: its plugin directory, which kubelet is there, and its own word.

Shared by both modes: the directory lock, the watch on kubelet's socket, and the pod-resources API.
"""
