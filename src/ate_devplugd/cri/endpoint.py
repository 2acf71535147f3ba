"""Which CRI socket to ask: the one kubelet uses, read from its command line and its config file.

A node can run more than one runtime (Docker's containerd beside kubelet's; k3s and RKE2 run their own
at ``/run/k3s/containerd/containerd.sock``), and only the one kubelet hands containers to matters. The
order, first match wins:

1. ``runtime_socket`` in our config;
2. the running kubelet's ``--container-runtime-endpoint`` flag (its last one, as its flag parser keeps);
3. ``containerRuntimeEndpoint`` in the KubeletConfiguration file its ``--config`` flag names (a path
   relative to kubelet's working directory; the flag wins over the file in kubelet too);
4. the usual sockets, the first that exists: containerd's, CRI-O's, k3s/RKE2's.

An endpoint is a ``unix://`` URL or a path; the scheme is stripped. This module holds the parsing and
the choice, with no I/O; ``cri.ask.discover`` reads kubelet's ``/proc/<pid>/cmdline`` and its file.
"""

from __future__ import annotations

import enum
import json
import posixpath
from collections.abc import Sequence
from dataclasses import dataclass

#: The runtimes' usual CRI sockets, asked in this order when neither we nor kubelet name one.
DEFAULT_RUNTIME_SOCKETS = (
    "/run/containerd/containerd.sock",
    "/run/crio/crio.sock",
    "/run/k3s/containerd/containerd.sock",
)
ENDPOINT_FLAG = "--container-runtime-endpoint"
CONFIG_FLAG = "--config"
#: The process name (``/proc/<pid>/comm``) kubelet runs under.
KUBELET_COMM = "kubelet"


class Source(enum.Enum):
    """Where the socket came from."""

    CONFIG = "config"
    KUBELET_FLAG = "kubelet-flag"
    KUBELET_CONFIG = "kubelet-config"
    USUAL = "usual"


@dataclass(frozen=True)
class Kubelet:
    """What was read of the running kubelet."""

    pid: int
    argv: tuple[str, ...]
    #: Its config file's path (absolute) and text, where ``--config`` names one that could be read.
    config_path: str = ""
    config_text: str | None = None


@dataclass(frozen=True)
class Endpoint:
    """The socket to ask ("" for the usual ones), and why."""

    socket: str
    source: Source
    why: str

    @property
    def named(self) -> bool:
        """Whether one socket is named (else the usual ones are tried)."""
        return self.source is not Source.USUAL


def flag(argv: Sequence[str], name: str) -> str | None:
    """The last value of ``--name=value`` or ``--name value`` in ``argv`` (pflag's forms), None without one."""
    value = None
    args = list(argv[1:])
    for i, arg in enumerate(args):
        if arg == "--":
            break
        if arg.startswith(name + "="):
            value = arg[len(name) + 1 :]
        elif arg == name and i + 1 < len(args):
            value = args[i + 1]
    return value


def socket_path(endpoint: str) -> str | None:
    """``unix:///run/containerd/containerd.sock`` or a path -> the path; None for another scheme."""
    endpoint = endpoint.strip()
    if endpoint.startswith("unix://"):
        endpoint = endpoint[len("unix://") :]
    elif "://" in endpoint:
        return None
    return posixpath.normpath(endpoint) if endpoint.startswith("/") else None


def config_endpoint(text: str) -> str | None:
    """``containerRuntimeEndpoint`` of a KubeletConfiguration file (YAML, or JSON), None without one."""
    import yaml  # noqa: PLC0415 - PyYAML only where kubelet has a config file

    try:
        data = json.loads(text) if text.lstrip().startswith("{") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError):
        return None
    value = data.get("containerRuntimeEndpoint") if isinstance(data, dict) else None
    return value if isinstance(value, str) and value else None


def config_file(argv: Sequence[str], cwd: str) -> str:
    """The path of kubelet's config file from its ``--config`` flag ("" without one), made absolute
    against kubelet's working directory."""
    path = flag(argv, CONFIG_FLAG) or ""
    return posixpath.join(cwd, path) if path and not path.startswith("/") else path


def choose(configured: str, kubelet: Kubelet | None) -> Endpoint:
    """The socket to ask, by the order of the module's docstring."""
    if configured:
        return Endpoint(configured, Source.CONFIG, "runtime_socket in our config")
    if kubelet is None:
        return Endpoint("", Source.USUAL, "no kubelet running")
    value = flag(kubelet.argv, ENDPOINT_FLAG)
    if value is not None:
        path = socket_path(value)
        if path is not None:
            return Endpoint(path, Source.KUBELET_FLAG, f"kubelet's {ENDPOINT_FLAG} (pid {kubelet.pid})")
        return Endpoint("", Source.USUAL, f"kubelet's {ENDPOINT_FLAG} {value} is not a unix socket")
    if kubelet.config_text is not None:
        value = config_endpoint(kubelet.config_text)
        path = socket_path(value) if value else None
        if path is not None:
            why = f"containerRuntimeEndpoint in kubelet's {kubelet.config_path} (pid {kubelet.pid})"
            return Endpoint(path, Source.KUBELET_CONFIG, why)
    return Endpoint("", Source.USUAL, f"kubelet (pid {kubelet.pid}) names no runtime endpoint")
