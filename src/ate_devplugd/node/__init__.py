"""The node's devices: what the kernel and udev say of them, KVM's announcements, and our CDI spec of them.

Shared by both modes; knows the configuration but nothing of kubelet or the container runtime.
"""
