"""Configuration: a TOML file, validated field by field into frozen dataclasses.

Nothing here touches the file system beyond reading the one file; every error names the key, the
``[[device]]`` table it sits in and the bad value, and all errors are reported together.
"""

from __future__ import annotations

import dataclasses
import posixpath
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_CONFIG_PATH = Path("/etc/ate-devplugd/config.toml")
DEFAULT_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
DEFAULT_COUNT = 4096
#: Upper bound on units per resource. The ListAndWatch message must also fit in MAX_MESSAGE_BYTES.
MAX_COUNT = 65536
#: Half of kubelet's 4 MiB gRPC receive limit: one ListAndWatch message must stay well below it.
MAX_MESSAGE_BYTES = 2 * 1024 * 1024
LOG_LEVELS = ("debug", "info", "warning", "error")
PROBES = ("kvm",)

_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN = re.compile(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*\Z")
_QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]\Z")
_SUBSYSTEM = re.compile(r"[a-z0-9][a-z0-9_-]*\Z")


class ConfigError(Exception):
    """One or more configuration errors; each line names the field and the bad value."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("\n".join(errors))
        self.errors = errors


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

    @property
    def socket_name(self) -> str:
        """Base name of this resource's plugin socket: ``ate.dev/kvm`` -> ``ate.dev-kvm.sock``."""
        return self.resource.replace("/", "-") + ".sock"

    @property
    def id_prefix(self) -> str:
        """Device IDs are ``<node name>-<n>``, e.g. ``kvm-0``; stable across restarts."""
        return posixpath.basename(self.path) + "-"


DEFAULT_DEVICES = (DeviceConfig(resource="ate.dev/kvm", path="/dev/kvm"),)


@dataclass(frozen=True)
class Config:
    """The whole daemon configuration."""

    plugin_dir: str = DEFAULT_PLUGIN_DIR
    dev_root: str = "/"
    log_level: str = "info"
    devices: tuple[DeviceConfig, ...] = field(default=DEFAULT_DEVICES)

    def with_overrides(
        self, *, plugin_dir: str | None = None, dev_root: str | None = None, log_level: str | None = None
    ) -> Config:
        """Apply command-line overrides, validated like the file's values."""
        errors: list[str] = []
        changes: dict[str, Any] = {}
        if plugin_dir is not None:
            changes["plugin_dir"] = _abs_dir("--plugin-dir", plugin_dir, errors)
        if dev_root is not None:
            changes["dev_root"] = _abs_dir("--dev-root", dev_root, errors)
        if log_level is not None:
            changes["log_level"] = _log_level("--log-level", log_level, errors)
        if errors:
            raise ConfigError(errors)
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class ConfigDiff:
    """Resource names by what a new config does to them, each in the new (or old) config's order."""

    added: tuple[str, ...]
    changed: tuple[str, ...]
    removed: tuple[str, ...]
    unchanged: tuple[str, ...]


def diff(old: Config, new: Config) -> ConfigDiff:
    """Compare the ``[[device]]`` tables of two configs by resource name (a resource's identity)."""
    before = {dev.resource: dev for dev in old.devices}
    after = {dev.resource: dev for dev in new.devices}
    return ConfigDiff(
        added=tuple(name for name in after if name not in before),
        changed=tuple(name for name in after if name in before and after[name] != before[name]),
        removed=tuple(name for name in before if name not in after),
        unchanged=tuple(name for name in after if name in before and after[name] == before[name]),
    )


def is_extended_resource_name(name: str) -> bool:
    """Kubelet's rule for a device plugin's resource name (an extended resource name)."""
    if "/" not in name or "kubernetes.io/" in name or name.startswith("requests."):
        return False
    prefix, _, rest = ("requests." + name).partition("/")
    if "/" in rest or not rest or len(rest) > 63 or not _QUALIFIED_NAME.match(rest):
        return False
    return len(prefix) <= 253 and bool(_DNS_SUBDOMAIN.match(prefix))


def listandwatch_bytes(dev: DeviceConfig) -> int:
    """Upper bound on the encoded size of one ListAndWatch message for ``dev``.

    Each Device is a length-delimited entry holding the ID and the health string; counted with the
    longest health string ("Unhealthy") and 2-byte length prefixes, so the estimate never falls short.
    """
    longest_id = len(dev.id_prefix) + len(str(dev.count - 1))
    per_device = 1 + 2 + (1 + 1 + longest_id) + (1 + 1 + len("Unhealthy"))
    return dev.count * per_device


def max_request_bytes(dev: DeviceConfig) -> int:
    """The largest request the plugin server accepts for ``dev``; gRPC answers RESOURCE_EXHAUSTED above it.

    kubelet's largest request names every unit at most twice (GetPreferredAllocation: the available IDs
    and the ones it must include), for one container. This allows every unit four times over, with
    3-byte framing per ID, plus 64 KiB: far above anything kubelet sends, and far below gRPC's default
    4 MiB, whose decoded ID lists would cost the daemon a hundred MiB or more.
    """
    longest_id = len(dev.id_prefix) + len(str(dev.count - 1))
    return 64 * 1024 + 4 * dev.count * (3 + longest_id)


def load(path: Path | None) -> Config:
    """Read and validate the config file; ``None`` or a missing default file gives the defaults."""
    if path is None:
        if not DEFAULT_CONFIG_PATH.exists():
            return Config()
        path = DEFAULT_CONFIG_PATH
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([f"{path}: cannot read: {exc}"]) from exc
    return parse(text, source=str(path))


def parse(text: str, source: str = "<config>") -> Config:
    """Parse TOML text into a validated Config."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{source}: not valid TOML: {exc}"]) from exc
    return from_mapping(data)


def from_mapping(data: Mapping[str, Any]) -> Config:
    """Validate an already-parsed mapping (the TOML document)."""
    errors: list[str] = []
    known = {"plugin_dir", "dev_root", "log_level", "device"}
    errors.extend(f"unknown key {key!r}" for key in data if key not in known)
    top: dict[str, Any] = {}
    if "plugin_dir" in data:
        top["plugin_dir"] = _abs_dir("plugin_dir", data["plugin_dir"], errors)
    if "dev_root" in data:
        top["dev_root"] = _abs_dir("dev_root", data["dev_root"], errors)
    if "log_level" in data:
        top["log_level"] = _log_level("log_level", data["log_level"], errors)
    if "device" in data:
        top["devices"] = _devices(data["device"], errors)
    if errors:
        raise ConfigError(errors)
    return Config(**top)


def _abs_dir(key: str, value: object, errors: list[str]) -> str:
    if not isinstance(value, str):
        errors.append(f"{key}: must be a string, not {value!r}")
    elif not value.startswith("/") or "\0" in value:
        errors.append(f"{key}: must be an absolute path, not {value!r}")
    else:
        return posixpath.normpath(value)
    return ""


def _log_level(key: str, value: object, errors: list[str]) -> str:
    if isinstance(value, str) and value.lower() in LOG_LEVELS:
        return value.lower()
    errors.append(f"{key}: must be one of {', '.join(LOG_LEVELS)}, not {value!r}")
    return "info"


def _devices(value: object, errors: list[str]) -> tuple[DeviceConfig, ...]:
    if not isinstance(value, list) or not value:
        errors.append(f"device: must be one or more [[device]] tables, not {value!r}")
        return ()
    devices: list[DeviceConfig] = []
    seen: dict[str, dict[str, str]] = {"resource": {}, "path": {}, "socket": {}}
    for index, table in enumerate(value):
        where = f"device[{index}]"
        if not isinstance(table, dict):
            errors.append(f"{where}: must be a table, not {table!r}")
            continue
        if isinstance(table.get("resource"), str):
            name = table["resource"]
            # quoted when it holds control characters: an error is one line in the journal, never more
            where = f"device[{index}] ({name if name.isprintable() else repr(name)})"
        dev = _device(where, table, errors)
        if dev is None:
            continue
        for kind, key in (("resource", dev.resource), ("path", dev.path), ("socket", dev.socket_name)):
            if key in seen[kind]:
                what = "socket name" if kind == "socket" else kind
                errors.append(f"{where}: {what} {key!r} is already used by {seen[kind][key]}")
            seen[kind][key] = where
        devices.append(dev)
    return tuple(devices)


def _device(where: str, table: dict[str, Any], errors: list[str]) -> DeviceConfig | None:
    before = len(errors)
    fields = {f.name for f in dataclasses.fields(DeviceConfig)}
    errors.extend(f"{where}: unknown key {key!r}" for key in table if key not in fields)
    for key in ("resource", "path"):
        if key not in table:
            errors.append(f"{where}: {key}: required")

    resource = table.get("resource", "")
    if "resource" in table and not (isinstance(resource, str) and is_extended_resource_name(resource)):
        errors.append(
            f"{where}: resource: {resource!r} is not an extended resource name "
            "(domain/name, e.g. 'ate.dev/kvm'; not kubernetes.io)"
        )
    path = table.get("path", "")
    if "path" in table and not _is_dev_path(path):
        errors.append(f"{where}: path: {path!r} must be a normalised absolute path under /dev, e.g. '/dev/kvm'")
    count = table.get("count", DEFAULT_COUNT)
    if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= MAX_COUNT:
        errors.append(f"{where}: count: {count!r} must be an integer from 1 to {MAX_COUNT}")
    perms = table.get("permissions", "rw")
    if not (isinstance(perms, str) and perms and set(perms) <= set("rwm") and len(set(perms)) == len(perms)):
        errors.append(f"{where}: permissions: {perms!r} must be a non-empty combination of 'r', 'w', 'm'")
    preopen = table.get("preopen", False)
    if not isinstance(preopen, bool):
        errors.append(f"{where}: preopen: must be true or false, not {preopen!r}")
    probe = table.get("probe")
    if probe is not None and probe not in PROBES:
        errors.append(f"{where}: probe: {probe!r} must be one of {', '.join(PROBES)}")
    subsystem = table.get("subsystem", "misc")
    if not (isinstance(subsystem, str) and _SUBSYSTEM.match(subsystem)):
        errors.append(f"{where}: subsystem: {subsystem!r} must be a udev subsystem name such as 'misc'")
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
    )
    if len(dev.id_prefix) + len(str(count - 1)) > 63:
        errors.append(f"{where}: path: {path!r} makes device IDs longer than kubelet's 63 characters")
        return None
    if listandwatch_bytes(dev) > MAX_MESSAGE_BYTES:
        errors.append(
            f"{where}: count: {count} makes one ListAndWatch message about {listandwatch_bytes(dev)} bytes; "
            f"the limit is {MAX_MESSAGE_BYTES} (half of kubelet's 4 MiB)"
        )
        return None
    return dev


def _is_dev_path(path: object) -> bool:
    return (
        isinstance(path, str)
        and path.startswith("/dev/")
        and len(path) > len("/dev/")
        and "\0" not in path
        and posixpath.normpath(path) == path
    )


def render(config: Config) -> str:
    """The effective configuration, as TOML that ``parse`` reads back to the same Config."""
    lines = [
        f"plugin_dir = {_toml_str(config.plugin_dir)}",
        f"dev_root = {_toml_str(config.dev_root)}",
        f"log_level = {_toml_str(config.log_level)}",
    ]
    for dev in config.devices:
        lines += [
            "",
            "[[device]]",
            f"resource = {_toml_str(dev.resource)}",
            f"path = {_toml_str(dev.path)}",
            f"count = {dev.count}",
            f"permissions = {_toml_str(dev.permissions)}",
            f"preopen = {'true' if dev.preopen else 'false'}",
        ]
        if dev.probe is not None:
            lines.append(f"probe = {_toml_str(dev.probe)}")
        lines.append(f"subsystem = {_toml_str(dev.subsystem)}")
    return "\n".join(lines) + "\n"


def _toml_str(value: str) -> str:
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + "".join(c if c.isprintable() else f"\\U{ord(c):08x}" for c in escaped) + '"'
