"""Real container runtimes driven as kubelet drives them (CRI over gRPC): ``tests.runtimes.containerd``."""
