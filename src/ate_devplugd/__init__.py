"""ate-devplugd: a kubelet device plugin for /dev/kvm and friends, run as a systemd host service."""

__version__ = "0.1.0"
