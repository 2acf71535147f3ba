"""The container runtime kubelet uses: which CRI socket, what it answers, and what it does with our CDI names.

The CDI library's rules (which spec a name resolves to), other specs that define our names, the check the daemon
keeps running on the runtime, and the remedies ``doctor`` prints. Shared by both modes.
"""
