"""One ``[[device]]`` table: a device node advertised as one extended resource, and how it is checked.

Every check names the table (``device[0] (ate.dev/kvm)``), the key and the bad value; all errors of
all tables are reported together. The bounds on ``count`` come from kubelet's limits (the ListAndWatch
message) and from what the daemon accepts per request.
"""

from __future__ import annotations

import dataclasses
import grp
import posixpath
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ate_devplugd.base.toml_text import toml_setting, toml_str, toml_value

DEFAULT_COUNT = 4096
#: Upper bound on units per resource. The ListAndWatch message must also fit in MAX_MESSAGE_BYTES.
MAX_COUNT = 65536
#: Half of kubelet's 4 MiB gRPC receive limit: one ListAndWatch message must stay well below it.
MAX_MESSAGE_BYTES = 2 * 1024 * 1024
#: Above this, ``check-config`` warns of what the units cost kubelet (``count_cost``).
COSTLY_COUNT = 16384
#: kubelet's device manager (1.32.10, measured) holds about this much heap per unit of a resource.
KUBELET_BYTES_PER_UNIT = 214
PROBES = ("kvm",)
#: The node's mode in the container when a CDI-enabled table gives none: any user may open it.
DEFAULT_CONTAINER_MODE = 0o666

_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN = re.compile(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*\Z")
_QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]\Z")
_SUBSYSTEM = re.compile(r"[a-z0-9][a-z0-9_-]*\Z")
# CDI's names, as the strictest CDI library in use parses them (container-device-interface v0.5.x:
# a class holds no dot); see node/cdi.py.
_CDI_VENDOR = re.compile(r"[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?\Z")
_CDI_CLASS = re.compile(r"[A-Za-z]([A-Za-z0-9_-]*[A-Za-z0-9])?\Z")
_CDI_DEVICE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?\Z")

GroupLookup = Callable[[str], int]


def host_gid(name: str) -> int:
    """The host's gid of group ``name`` (KeyError if there is none)."""
    return grp.getgrnam(name).gr_gid


@dataclass(frozen=True)
class DeviceConfig:
    """One device node advertised to kubelet as one extended resource."""

    resource: str
    path: str
    count: int = DEFAULT_COUNT
    permissions: str = "rw"
    preopen: bool = False
    probe: str | None = None
    subsystem: str = "misc"
    #: Write a CDI spec for the node and name it in Allocate (the container-side owner and mode below).
    cdi: bool = False
    #: ``cdi = "required"``: withheld whenever the runtime kubelet uses does not apply our CDI names.
    cdi_required: bool = False
    container_mode: int | None = None
    container_uid: int | None = None
    container_gid: int | None = None
    #: ``container_gid`` as written when it is a group name (resolved on the host at each load).
    container_group: str | None = None

    def __post_init__(self) -> None:  # the mode in effect: a table that leaves it unset means 0o666
        if self.cdi and self.container_mode is None:
            object.__setattr__(self, "container_mode", DEFAULT_CONTAINER_MODE)

    @property
    def socket_name(self) -> str:
        """Base name of this resource's plugin socket: ``ate.dev/kvm`` -> ``ate.dev-kvm.sock``."""
        return self.resource.replace("/", "-") + ".sock"

    @property
    def id_prefix(self) -> str:
        """Device IDs are ``<node name>-<n>``, e.g. ``kvm-0``; stable across restarts."""
        return posixpath.basename(self.path) + "-"

    @property
    def longest_id_len(self) -> int:
        """The length of the last unit's ID, the longest."""
        return len(self.id_prefix) + len(str(self.count - 1))

    @property
    def cdi_name(self) -> str:
        """The CDI device name: the node's file name (``kvm``); qualified, ``ate.dev/kvm=kvm``."""
        return posixpath.basename(self.path)

    @property
    def node_mode(self) -> int:
        """The node's mode in the container, with CDI."""
        return DEFAULT_CONTAINER_MODE if self.container_mode is None else self.container_mode


def qualified_name(dev: DeviceConfig) -> str:
    """The CDI name the runtime is given (by Allocate, or in DRA mode by the prepared claim): ``ate.dev/kvm=kvm``,
    the spec's kind and its one device."""
    return f"{dev.resource}={dev.cdi_name}"


def count_cost(count: int) -> str:
    """What ``count`` units cost kubelet, for ``check-config``'s warning (the figures are in docs/operating.md)."""
    heap = count * KUBELET_BYTES_PER_UNIT / 2**20
    return (
        f"units cost kubelet about {heap:.1f} MiB of heap ({KUBELET_BYTES_PER_UNIT} B a unit), and time and disk "
        "that grow with them (at 65536: 97 ms to handle each health update, a 775 KB checkpoint written and "
        "fsynced on every Allocate; at 4096, the default: 2.4 ms, 44 KB); every unit is the same node, so "
        "count need only cover the units the node's containers may hold at once"
    )


def is_extended_resource_name(name: str) -> bool:
    """Kubelet's rule for a device plugin's resource name (an extended resource name)."""
    if "/" not in name or "kubernetes.io/" in name or name.startswith("requests."):
        return False
    prefix, _, rest = ("requests." + name).partition("/")
    if "/" in rest or not rest or len(rest) > 63 or not _QUALIFIED_NAME.match(rest):
        return False
    return is_dns_subdomain(prefix)


def is_dns_subdomain(value: str, max_len: int = 253) -> bool:
    """A lowercase DNS subdomain (RFC 1123) of at most ``max_len`` characters."""
    return 0 < len(value) <= max_len and bool(_DNS_SUBDOMAIN.match(value))


def listandwatch_bytes(dev: DeviceConfig) -> int:
    """Upper bound on the encoded size of one ListAndWatch message for ``dev``.

    Each Device is a length-delimited entry holding the ID and the health string; counted with the
    longest health string ("Unhealthy") and 2-byte length prefixes, so the estimate never falls short.
    """
    per_device = 1 + 2 + (1 + 1 + dev.longest_id_len) + (1 + 1 + len("Unhealthy"))
    return dev.count * per_device


def max_request_bytes(dev: DeviceConfig) -> int:
    """The largest request the plugin server accepts for ``dev``; gRPC answers RESOURCE_EXHAUSTED above it.

    kubelet's largest request names every unit at most twice (GetPreferredAllocation: the available IDs
    and the ones it must include), for one container. This allows every unit four times over, with
    3-byte framing per ID, plus 64 KiB: far above anything kubelet sends, and far below gRPC's default
    4 MiB, whose decoded ID lists would cost the daemon a hundred MiB or more.
    """
    return 64 * 1024 + 4 * dev.count * (3 + dev.longest_id_len)


def tables(
    value: object, errors: list[str], gid_of: GroupLookup = host_gid, *, cdi_required: bool = False
) -> tuple[DeviceConfig, ...]:
    """The ``[[device]]`` tables, checked; each error appended names table, key and value. With
    ``cdi_required`` (DRA mode) ``cdi`` is true unless a table says otherwise, which is an error."""
    if not isinstance(value, list) or not value:
        errors.append(f"device: must be one or more [[device]] tables, not {toml_value(value)}")
        return ()
    devices: list[DeviceConfig] = []
    seen: dict[str, dict[str, str]] = {"resource": {}, "path": {}, "socket name": {}}
    for index, table in enumerate(value):
        where = f"device[{index}]"
        if not isinstance(table, dict):
            errors.append(f"{where}: must be a table, not {toml_value(table)}")
            continue
        if isinstance(table.get("resource"), str):
            name = table["resource"]
            # quoted when it holds control characters: an error is one line in the journal, never more
            where = f"device[{index}] ({name if name.isprintable() else toml_str(name)})"
        if cdi_required and table.get("cdi", True) not in (True, "required"):
            errors.append(f"{where}: cdi: must be true in DRA mode (DRA gives containers devices only through CDI)")
        dev = _device(where, {**table, "cdi": table.get("cdi", True)} if cdi_required else table, errors, gid_of)
        if dev is None:
            continue
        # One line per table, however many of its names clash: the same socket name follows from the
        # same resource, and a table given twice clashes in resource and path at once.
        names = (("resource", dev.resource), ("path", dev.path), ("socket name", dev.socket_name))
        clashes: dict[str, list[str]] = {}  # the earlier table -> our names it already uses
        for kind, key in names:
            if key in seen[kind] and not (kind == "socket name" and dev.resource in seen["resource"]):
                clashes.setdefault(seen[kind][key], []).append(f"{kind} {toml_value(key)}")
        if clashes:
            errors.append(
                f"{where}: "
                + "; ".join(
                    f"{' and '.join(used)} {'are' if len(used) > 1 else 'is'} already used by {other}"
                    for other, used in clashes.items()
                )
            )
        for kind, key in names:
            seen[kind].setdefault(key, where)
        devices.append(dev)
    return tuple(devices)


def _device(where: str, table: dict[str, Any], errors: list[str], gid_of: GroupLookup) -> DeviceConfig | None:
    before = len(errors)
    fields = {f.name for f in dataclasses.fields(DeviceConfig)} - {"container_group", "cdi_required"}
    errors.extend(f"{where}: unknown key {toml_value(key)}" for key in table if key not in fields)
    for key in ("resource", "path"):
        if key not in table:
            errors.append(f"{where}: {key}: required")

    resource = table.get("resource", "")
    if "resource" in table and not (isinstance(resource, str) and is_extended_resource_name(resource)):
        errors.append(
            f"{where}: resource: {toml_value(resource)} is not an extended resource name "
            "(domain/name, e.g. 'ate.dev/kvm'; not kubernetes.io)"
        )
    path = table.get("path", "")
    if "path" in table and not _is_dev_path(path):
        errors.append(
            f"{where}: path: {toml_value(path)} must be a normalised absolute path under /dev, e.g. '/dev/kvm'"
        )
    count = table.get("count", DEFAULT_COUNT)
    if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= MAX_COUNT:
        errors.append(f"{where}: count: {toml_value(count)} must be an integer from 1 to {MAX_COUNT}")
    perms = table.get("permissions", "rw")
    if not (isinstance(perms, str) and perms and set(perms) <= set("rwm") and len(set(perms)) == len(perms)):
        errors.append(f"{where}: permissions: {toml_value(perms)} must be a non-empty combination of 'r', 'w', 'm'")
    preopen = table.get("preopen", False)
    if not isinstance(preopen, bool):
        errors.append(f"{where}: preopen: must be true or false, not {toml_value(preopen)}")
    probe = table.get("probe")
    if probe is not None and probe not in PROBES:
        errors.append(f"{where}: probe: {toml_value(probe)} must be one of {', '.join(PROBES)}")
    subsystem = table.get("subsystem", "misc")
    if not (isinstance(subsystem, str) and _SUBSYSTEM.match(subsystem)):
        errors.append(f"{where}: subsystem: {toml_value(subsystem)} must be a udev subsystem name such as 'misc'")
    cdi = _cdi_keys(where, table, errors, gid_of)
    if len(errors) > before:
        return None
    dev = DeviceConfig(
        resource=resource,
        path=path,
        count=count,
        permissions=perms,
        preopen=preopen,
        probe=probe,
        subsystem=subsystem,
        **cdi,
    )
    if dev.longest_id_len > 63:
        errors.append(f"{where}: path: {toml_value(path)} makes device IDs longer than kubelet's 63 characters")
        return None
    message_bytes = listandwatch_bytes(dev)
    if message_bytes > MAX_MESSAGE_BYTES:
        errors.append(
            f"{where}: count: {count} makes one ListAndWatch message about {message_bytes} bytes; "
            f"the limit is {MAX_MESSAGE_BYTES} (half of kubelet's 4 MiB)"
        )
        return None
    return dev


def _cdi_keys(where: str, table: dict[str, Any], errors: list[str], gid_of: GroupLookup) -> dict[str, Any]:
    """``cdi`` and the container-side owner and mode; the group name resolved to the host's gid."""
    resource, path = table.get("resource"), table.get("path")
    cdi = table.get("cdi", False)
    if not isinstance(cdi, bool) and cdi != "required":
        errors.append(f"{where}: cdi: must be true, false or 'required', not {toml_value(cdi)}")
        return {}
    out: dict[str, Any] = {"cdi": cdi is not False, "cdi_required": cdi == "required"}
    cdi = cdi is not False
    given = [key for key in ("container_mode", "container_uid", "container_gid") if key in table]
    if given and not cdi:
        errors.append(f"{where}: {given[0]}: takes effect only with cdi = true")
    mode = table.get("container_mode")
    if mode is not None and not (isinstance(mode, int) and not isinstance(mode, bool) and 0 <= mode <= 0o777):
        errors.append(
            f"{where}: container_mode: {toml_value(mode, octal=True)} "
            "must be a file mode from 0o000 to 0o777, e.g. 0o666"
        )
    out["container_mode"] = mode
    uid = table.get("container_uid")
    if uid is not None and not (isinstance(uid, int) and not isinstance(uid, bool) and 0 <= uid < 2**32 - 1):
        errors.append(f"{where}: container_uid: {toml_value(uid)} must be a uid (an integer from 0)")
    out["container_uid"] = uid
    gid = table.get("container_gid")
    if isinstance(gid, str):
        try:
            out["container_gid"], out["container_group"] = gid_of(gid), gid
        except KeyError:
            errors.append(f"{where}: container_gid: group {toml_value(gid)} does not exist on this host")
    elif gid is not None and not (isinstance(gid, int) and not isinstance(gid, bool) and 0 <= gid < 2**32 - 1):
        errors.append(f"{where}: container_gid: {toml_value(gid)} must be a gid (an integer from 0) or a group name")
    else:
        out["container_gid"] = gid
    if cdi and isinstance(resource, str) and isinstance(path, str):
        vendor, _, kind_class = resource.partition("/")
        if not (_CDI_VENDOR.match(vendor) and _CDI_CLASS.match(kind_class)):
            errors.append(
                f"{where}: resource: {toml_value(resource)} is not a CDI kind, which cdi = true needs "
                "(vendor/class; the class holds only letters, digits, '_' and '-', and starts with a letter)"
            )
        if not _CDI_DEVICE.match(posixpath.basename(path)):
            errors.append(
                f"{where}: path: {toml_value(path)} does not end in a CDI device name (letters, digits, '_.:-')"
            )
    return out


def _is_dev_path(path: object) -> bool:
    return (
        isinstance(path, str)
        and path.startswith("/dev/")
        and len(path) > len("/dev/")
        and "\0" not in path
        and posixpath.normpath(path) == path
    )


def values(dev: DeviceConfig) -> dict[str, Any]:
    """The table as the keys of a ``[[device]]`` table, each with the value in effect (a default the file
    leaves unset is written out): ``tables`` reads it back to the same DeviceConfig."""
    out: dict[str, Any] = {
        "resource": dev.resource,
        "path": dev.path,
        "count": dev.count,
        "permissions": dev.permissions,
        "preopen": dev.preopen,
    }
    if dev.probe is not None:
        out["probe"] = dev.probe
    out["subsystem"] = dev.subsystem
    if dev.cdi:
        out["cdi"] = "required" if dev.cdi_required else True
        out["container_mode"] = dev.node_mode
        if dev.container_uid is not None:
            out["container_uid"] = dev.container_uid
        gid = dev.container_group if dev.container_group is not None else dev.container_gid
        if gid is not None:
            out["container_gid"] = gid
    return out


def render(dev: DeviceConfig) -> list[str]:
    """The table as TOML lines (its ``values``), with the host's gid beside a group name."""
    lines = ["[[device]]"]
    for key, value in values(dev).items():
        text = toml_value(value, octal=True) if key == "container_mode" else toml_setting(value)
        gid = key == "container_gid" and dev.container_group is not None
        lines.append(f"{key} = {text}" + (f"  # gid {dev.container_gid} here" if gid else ""))
    return lines
