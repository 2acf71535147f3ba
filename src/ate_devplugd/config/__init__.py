"""Configuration: a TOML file, validated field by field into frozen dataclasses.

Loading is the one validation, the same for start, reload, ``check-config`` and ``doctor``: every check
runs, and all errors are reported together. It reads the one file and looks at each device path on this
host (``config.host``: a directory is an error); a group name in ``container_gid`` is looked up in the
host's group database, and DRA mode's default node name is the host name. Every error names the key, the
``[[device]]`` table it sits in and the bad value (as TOML); the command line's overrides (``run
--plugin-dir``...) are checked in the same round, as their options. ``review`` says what else a valid
config means (warnings, notes).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from ate_devplugd.base.look import Look, look
from ate_devplugd.base.toml_text import toml_setting, toml_value
from ate_devplugd.config import device as device_config
from ate_devplugd.config import host, toplevel
from ate_devplugd.config.device import DeviceConfig, GroupLookup, host_gid, qualified_name

if TYPE_CHECKING:
    from ate_devplugd.config.dra import DraConfig

DEFAULT_CONFIG_PATH = "/etc/ate-devplugd/config.toml"
DEFAULT_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
#: CDI's standard directory for specs a program writes at run time (containerd, CRI-O and podman read it).
DEFAULT_CDI_DIR = "/var/run/cdi"
#: node_exporter's textfile directory on Debian, and our file in it.
DEFAULT_METRICS_FILE = "/var/lib/prometheus/node-exporter/ate-devplugd.prom"
#: Keys a reload cannot change: the plugin directory (the instance lock and the sockets' home), the mode
#: and the ``[dra]`` table (a new mode would read the devices under other rules: DRA mode gives each a CDI
#: spec).
RESTART_ONLY = ("plugin_dir", "mode", "dra")
#: The top-level keys, in the file's order.
TOP_KEYS = (
    "plugin_dir",
    "dev_root",
    "log_level",
    "cdi_dir",
    "metrics_file",
    "runtime_socket",
    "mode",
    "handover_guard",
)

__all__ = [
    "Config",
    "ConfigError",
    "diff",
    "load",
    "parse",
    "render",
    "restart_only_change",
    "values",
]


class ConfigError(Exception):
    """One or more configuration errors; each line names the field and the bad value."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("\n".join(errors))
        self.errors = errors


DEFAULT_DEVICES = (DeviceConfig(resource="ate.dev/kvm", path="/dev/kvm"),)


@dataclass(frozen=True)
class Config:
    """The whole daemon configuration."""

    plugin_dir: str = DEFAULT_PLUGIN_DIR
    dev_root: str = "/"
    log_level: str = "info"
    cdi_dir: str = DEFAULT_CDI_DIR
    #: The metrics file for node_exporter's textfile collector; "" turns metrics off.
    metrics_file: str = DEFAULT_METRICS_FILE
    #: The container runtime's CRI socket, asked whether it applies CDI; "" for the first usual one that exists.
    runtime_socket: str = ""
    #: Every handover (an upgrade's too) runs under switch-mode's cordon, with the ``[dra]`` table's
    #: credentials: no arriving pod lost, none taken for its seconds (``commands.guard``).
    handover_guard: bool = False
    devices: tuple[DeviceConfig, ...] = field(default=DEFAULT_DEVICES)
    #: ``device-plugin`` (kubelet's device-plugin API) or ``dra`` (a DRA driver); never both at once.
    mode: str = "device-plugin"
    #: The ``[dra]`` table: read in DRA mode, and checked whenever it is given.
    dra: DraConfig | None = None
    #: No ``[[device]]`` table was read: ``devices`` are the defaults (``check-config`` says so).
    devices_defaulted: bool = field(default=False, compare=False)

    @property
    def checks_runtime(self) -> bool:
        """Whether the container runtime is asked about CDI: a resource uses CDI, or DRA mode (CDI is its
        only path)."""
        return self.mode == "dra" or any(dev.cdi for dev in self.devices)

    def with_overrides(
        self, *, plugin_dir: str | None = None, dev_root: str | None = None, log_level: str | None = None
    ) -> Config:
        """Apply command-line overrides, validated like the file's values."""
        errors: list[str] = []
        changes = _overrides({"plugin_dir": plugin_dir, "dev_root": dev_root, "log_level": log_level}, errors)
        if errors:
            raise ConfigError(errors)
        return dataclasses.replace(self, **changes)


#: The command line's overrides of the file: a key of the file -> its value (None: not given).
Overrides = Mapping[str, "str | None"]


def _overrides(given: Overrides, errors: list[str]) -> dict[str, Any]:
    """The overrides given, each checked as its option (``--plugin-dir``) is named."""
    checks: dict[str, Callable[[str, object, list[str]], str]] = {
        "plugin_dir": toplevel.abs_dir,
        "dev_root": toplevel.abs_dir,
        "log_level": toplevel.log_level,
    }
    return {
        key: checks[key]("--" + key.replace("_", "-"), value, errors)
        for key, value in given.items()
        if value is not None
    }


class ConfigDiff(NamedTuple):
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


def restart_only_change(running: Config, new: Config) -> str | None:
    """One line naming each restart-only key (``RESTART_ONLY``) ``new`` changes, new value first, as TOML;
    None when a reload may apply ``new``."""
    parts = []
    for key in RESTART_ONLY:
        was, now = getattr(running, key), getattr(new, key)
        if now == was:
            continue
        if key == "dra":  # a table: said in a word
            parts.append("[dra] " + ("added" if was is None else "removed" if now is None else "changed"))
        else:
            parts.append(f"{key} = {toml_value(now)} (running: {toml_value(was)})")
    if not parts:
        return None
    verb = "changes" if len(parts) == 1 else "change"
    return f"{', '.join(parts)}: {verb} only on restart, so nothing of this reload was applied"


def load(
    path: str | os.PathLike[str] | None, gid_of: GroupLookup = host_gid, overrides: Overrides | None = None
) -> Config:
    """Read and validate the config file (with the command line's ``overrides``), every check in one
    round; ``None`` or a missing default file gives the defaults."""
    if path is None:
        if look(DEFAULT_CONFIG_PATH) is Look.ABSENT:  # one it cannot look at is read, and says why
            return from_mapping({}, gid_of, overrides=overrides)
        path = DEFAULT_CONFIG_PATH
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise ConfigError([f"cannot read {os.fspath(path)}: {exc.strerror or exc}"]) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(
            [f"cannot read {os.fspath(path)}: not UTF-8 (byte 0x{exc.object[exc.start]:02x} at offset {exc.start})"]
        ) from exc
    return parse(text, source=str(path), gid_of=gid_of, overrides=overrides)


def parse(
    text: str, source: str = "<config>", gid_of: GroupLookup = host_gid, overrides: Overrides | None = None
) -> Config:
    """Parse TOML text into a validated Config (group names resolved with ``gid_of``)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{source}: not valid TOML: {exc}"]) from exc
    return from_mapping(data, gid_of, overrides=overrides)


def from_mapping(
    data: Mapping[str, Any],
    gid_of: GroupLookup = host_gid,
    gethostname: Callable[[], str] = socket.gethostname,
    overrides: Overrides | None = None,
) -> Config:
    """Validate an already-parsed mapping (the TOML document)."""
    errors: list[str] = []
    known = {*TOP_KEYS, "device", "dra"}
    errors.extend(f"unknown key {toml_value(key)}" for key in data if key not in known)
    top: dict[str, Any] = {}
    for key in ("plugin_dir", "dev_root", "cdi_dir"):
        if key in data:
            top[key] = toplevel.abs_dir(key, data[key], errors)
    if "log_level" in data:
        top["log_level"] = toplevel.log_level("log_level", data["log_level"], errors)
    if "metrics_file" in data:
        top["metrics_file"] = toplevel.metrics_file(data["metrics_file"], errors)
    if "runtime_socket" in data:
        top["runtime_socket"] = toplevel.runtime_socket(data["runtime_socket"], errors)
    if "handover_guard" in data:
        top["handover_guard"] = toplevel.boolean("handover_guard", data["handover_guard"], errors)
    top.update(_overrides(overrides or {}, errors))
    mode = "device-plugin"
    if "mode" in data or "dra" in data:
        # DRA mode's checks are read only where the file speaks of it (they cost start-up a few ms).
        from ate_devplugd.config import dra as dra_config  # noqa: PLC0415

        mode, mode_errors = dra_config.validate_mode(data.get("mode"))
        errors.extend(mode_errors)
        top["mode"] = mode
        if mode == "dra" or "dra" in data:
            top["dra"], dra_errors = dra_config.from_mapping(data.get("dra"), gethostname)
            errors.extend(dra_errors)
    if top.get("handover_guard") and "dra" not in top:
        errors.append(
            "handover_guard: true needs the [dra] table (node_name, kubeconfig): the credentials the guard "
            "cordons the Node with, as switch-mode does"
        )
    # DRA hands a device to a container only through a CDI spec: in DRA mode every device has one.
    defaults = [{"resource": dev.resource, "path": dev.path} for dev in DEFAULT_DEVICES]
    devices = data.get("device", defaults if mode == "dra" else None)
    if devices is not None:
        top["devices"] = device_config.tables(devices, errors, gid_of, cdi_required=mode == "dra")
    top["devices_defaulted"] = "device" not in data
    errors.extend(host.path_errors(top.get("dev_root") or "/", devices))
    if mode == "dra" and not errors:
        from ate_devplugd.config.pools import DraResource, build_pools  # noqa: PLC0415

        offered = [DraResource(dev.resource, qualified_name(dev)) for dev in top["devices"]]
        errors.extend(build_pools(top["dra"], offered)[1])
    if errors:
        raise ConfigError(errors)
    return Config(**top)


class Review(NamedTuple):
    """What ``check-config`` says of a valid config beyond its errors (``load`` finds them all), one line each."""

    #: Legal but costly or unused settings (``count`` above COSTLY_COUNT, ``[dra]`` outside DRA mode):
    #: said, exit 0; the daemon logs each once at start.
    warnings: tuple[str, ...]
    #: What the file leaves to the defaults that a reader may not expect.
    notes: tuple[str, ...]


def review(config: Config) -> Review:
    """What ``check-config`` says of a loaded config beyond its errors: what each ``count`` costs kubelet,
    and whether the devices are the defaults."""
    warnings: list[str] = []
    notes: list[str] = []
    for index, dev in enumerate(config.devices):
        where = f"device[{index}] ({dev.resource})"
        if dev.count > device_config.COSTLY_COUNT and config.mode == "device-plugin":  # DRA: dra.devices
            warnings.append(f"{where}: count: {dev.count} {device_config.count_cost(dev.count)}")
    if config.dra is not None and config.mode != "dra":  # the setup of a node that switch-mode moves
        notes.append(
            "[dra]: in device-plugin mode it serves DRA unprepare only (for claims left on this node, where "
            "dra-mode.conf is linked) and names the Node for switch-mode and the handover guard; nothing is "
            "published, and a reload refuses any change to it (it changes only on restart)"
        )
    if config.devices_defaulted:
        default = ", ".join(f"{dev.resource} -> {dev.path}" for dev in config.devices)
        notes.append(f"no [[device]] table: serving the default {default}")
    return Review(tuple(warnings), tuple(notes))


def values(config: Config) -> dict[str, Any]:
    """The config as the TOML document's keys, each with the value in effect (a default the file leaves
    unset is written out): ``from_mapping`` reads it back to the same Config, and two configs that mean
    the same have the same values."""
    out: dict[str, Any] = {key: getattr(config, key) for key in TOP_KEYS}
    out["device"] = [device_config.values(dev) for dev in config.devices]
    if config.dra is not None:
        from ate_devplugd.config import dra as dra_config  # noqa: PLC0415

        out["dra"] = dra_config.values(config.dra)
    return out


def render(config: Config) -> str:
    """The effective configuration, as TOML that ``parse`` reads back to the same Config."""
    lines = [f"{key} = {toml_setting(getattr(config, key))}" for key in TOP_KEYS]
    for dev in config.devices:
        lines += ["", *device_config.render(dev)]
    if config.dra is not None:
        from ate_devplugd.config import dra as dra_config  # noqa: PLC0415

        lines += ["", dra_config.render(config.dra).rstrip("\n")]
    return "\n".join(lines) + "\n"
