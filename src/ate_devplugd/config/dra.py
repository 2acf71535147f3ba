"""The ``[dra]`` table and the top-level ``mode``: validated field by field into a frozen dataclass.

Like the daemon's own config: nothing here does I/O except asking for the host name; every error line
names the key and the bad value, and all errors are returned together.
"""

from __future__ import annotations

import enum
import posixpath
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ate_devplugd.base.toml_text import toml_setting, toml_value
from ate_devplugd.base.unixsock import staging_path
from ate_devplugd.config.device import is_dns_subdomain

MODES = ("device-plugin", "dra")
DEFAULT_DRIVER = "kvm.ate.dev"
DEFAULT_KUBECONFIG = "/etc/kubernetes/kubelet.conf"
DEFAULT_KUBELET_DIR = "/var/lib/kubelet"
#: A ResourceSlice holds at most 128 devices; one slice per pool keeps every update atomic.
MAX_DEVICES = 128
DEFAULT_DEVICES = 128
#: sun_path is 108 bytes with its NUL; gRPC binds a ``unix:`` path up to this (grpcio 1.51 and 1.85).
MAX_SOCKET_PATH = 107


class Layout(enum.StrEnum):
    """How a resource is laid out in its ResourceSlice (the ``sharing`` key's values)."""

    #: ``devices`` devices (``kvm-0`` ...), one per claim: from Kubernetes 1.34, and a pod may ask for 2.
    UNITS = "units"
    #: One device with ``allowMultipleAllocations``, shared by every claim (DRAConsumableCapacity).
    SHARED = "shared"


SHARING = tuple(layout.value for layout in Layout)


@dataclass(frozen=True)
class DraConfig:
    """What DRA mode needs beyond the device list."""

    node_name: str
    driver: str = DEFAULT_DRIVER
    kubeconfig: str = DEFAULT_KUBECONFIG
    kubelet_dir: str = DEFAULT_KUBELET_DIR
    #: None: not set, the layout follows what the API server keeps (``layout.py`` decides it).
    sharing: Layout | None = None
    devices: int = DEFAULT_DEVICES

    @property
    def plugin_socket(self) -> str:
        """Where DRAPlugin is served: ``<kubelet_dir>/plugins/<driver>/dra.sock``."""
        return posixpath.join(self.kubelet_dir, "plugins", self.driver, "dra.sock")

    @property
    def registration_socket(self) -> str:
        """Where kubelet's plugin watcher finds us: ``<kubelet_dir>/plugins_registry/<driver>-reg.sock``."""
        return posixpath.join(self.kubelet_dir, "plugins_registry", self.driver + "-reg.sock")


def kubelet_hostname(gethostname: Callable[[], str] = socket.gethostname) -> str:
    """The node name kubelet uses when not told otherwise: the host name, trimmed and lowercased."""
    return gethostname().strip().lower()


def validate_mode(value: object) -> tuple[str, list[str]]:
    """Check the top-level ``mode`` key; ``device-plugin`` when it is absent (None)."""
    if value is None:
        return "device-plugin", []
    if isinstance(value, str) and value in MODES:
        return value, []
    return "device-plugin", [f"mode: must be one of {', '.join(MODES)}, not {toml_value(value)}"]


def from_mapping(
    table: Mapping[str, Any] | None, gethostname: Callable[[], str] = socket.gethostname
) -> tuple[DraConfig, list[str]]:
    """Validate the parsed ``[dra]`` table (None: absent); returns the config and one line per error."""
    errors: list[str] = []
    data: Mapping[str, Any] = {} if table is None else table
    if not isinstance(data, Mapping):
        return DraConfig(node_name=""), [f"dra: must be a table, not {toml_value(data)}"]
    known = {"driver", "node_name", "kubeconfig", "kubelet_dir", "sharing", "devices"}
    errors.extend(f"dra: unknown key {toml_value(key)}" for key in data if key not in known)

    driver = data.get("driver", DEFAULT_DRIVER)
    if not (isinstance(driver, str) and is_dns_subdomain(driver, 63)):
        errors.append(
            f"dra.driver: {toml_value(driver)} must be a DNS subdomain of at most 63 characters, e.g. 'kvm.ate.dev'"
        )
        driver = DEFAULT_DRIVER

    if "node_name" in data:
        node_name = data["node_name"]
        if not (isinstance(node_name, str) and is_dns_subdomain(node_name)):
            errors.append(f"dra.node_name: {toml_value(node_name)} must be a node name (a lowercase DNS subdomain)")
            node_name = ""
    else:
        node_name = kubelet_hostname(gethostname)
        if not is_dns_subdomain(node_name):
            errors.append(
                f"dra.node_name: the host name {toml_value(node_name)} is not a valid node name; "
                "set node_name to the name of this node's Node object"
            )

    kubeconfig = _abs_path("dra.kubeconfig", data.get("kubeconfig", DEFAULT_KUBECONFIG), errors)
    kubelet_dir = _abs_path("dra.kubelet_dir", data.get("kubelet_dir", DEFAULT_KUBELET_DIR), errors)

    sharing = _sharing(data, errors)
    devices = data.get("devices", DEFAULT_DEVICES)
    if not isinstance(devices, int) or isinstance(devices, bool) or not 1 <= devices <= MAX_DEVICES:
        errors.append(
            f"dra.devices: {toml_value(devices)} must be an integer from 1 to {MAX_DEVICES} (one ResourceSlice)"
        )
        devices = DEFAULT_DEVICES
    elif sharing is Layout.SHARED and "devices" in data:
        errors.append(f'dra.devices: {toml_value(devices)} applies only to sharing = "units" ("shared" has one device)')

    config = DraConfig(
        node_name=node_name,
        driver=driver,
        kubeconfig=kubeconfig or DEFAULT_KUBECONFIG,
        kubelet_dir=kubelet_dir or DEFAULT_KUBELET_DIR,
        sharing=sharing,
        devices=devices,
    )
    for path in (config.plugin_socket, config.registration_socket):
        bound = staging_path(path)  # the longest path bound, one byte longer than the socket's
        if kubelet_dir and len(bound.encode()) > MAX_SOCKET_PATH:
            errors.append(
                f"dra.kubelet_dir: {toml_value(kubelet_dir)} makes the socket path {toml_value(bound)} "
                "(bound, then renamed to "
                f"{posixpath.basename(path)}) longer than {MAX_SOCKET_PATH} bytes"
            )
            break
    return config, errors


def _sharing(data: Mapping[str, Any], errors: list[str]) -> Layout | None:
    """The ``sharing`` key: a layout, or None where it is not set (the layout follows the cluster)."""
    if "sharing" not in data:
        return None
    if data["sharing"] in SHARING:
        return Layout(data["sharing"])
    errors.append(f"dra.sharing: must be one of {', '.join(SHARING)}, not {toml_value(data['sharing'])}")
    return None


def _abs_path(key: str, value: object, errors: list[str]) -> str:
    if isinstance(value, str) and value.startswith("/") and "\0" not in value:
        return posixpath.normpath(value)
    errors.append(f"{key}: must be an absolute path, not {toml_value(value)}")
    return ""


def values(config: DraConfig) -> dict[str, Any]:
    """The ``[dra]`` table's keys, each with the value in effect (the node name the host gave included):
    ``from_mapping`` reads it back to the same DraConfig."""
    out: dict[str, Any] = {
        "driver": config.driver,
        "node_name": config.node_name,
        "kubeconfig": config.kubeconfig,
        "kubelet_dir": config.kubelet_dir,
    }
    if config.sharing is not None:
        out["sharing"] = str(config.sharing)
    if config.sharing is not Layout.SHARED:
        out["devices"] = config.devices
    return out


def render(config: DraConfig) -> str:
    """The effective ``[dra]`` table as TOML (for ``check-config``), with what its layout means."""
    lines = ["[dra]"]
    for key, value in values(config).items():
        if key == "devices" and config.sharing is None:
            lines += FOLLOWS_CLUSTER
        lines.append(f"{key} = {toml_setting(value)}")
    if config.sharing is not Layout.UNITS:
        lines += SHARED_LIMITATION
    return "\n".join(lines) + "\n"


#: What ``check-config`` says where ``sharing`` is not set: the layout is decided at start.
FOLLOWS_CLUSTER = (
    "# sharing: not set, so the layout follows the cluster, decided at each start: shared where the API",
    "# server keeps allowMultipleAllocations (DRAConsumableCapacity, on from Kubernetes 1.36), units where",
    "# it drops it (1.34-1.35); STATUS, probe and doctor say which it is",
)
#: What ``check-config`` says of a shared layout: a request for 2 units has no answer there.
SHARED_LIMITATION = (
    "# shared: one device per resource, which the scheduler never allocates twice in one request: a pod",
    "# asking for 2 or more (e.g. ate.dev/kvm: 2) stays Pending for ever; ask for 1 (one /dev/kvm serves",
    '# any number of VMs), or use sharing = "units", where 2 units give two devices and one /dev/kvm.',
)
