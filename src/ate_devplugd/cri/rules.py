"""The CDI library's rules for which spec files load and which spec a qualified name resolves to.

containerd and CRI-O read CDI specs through the CDI library (tags.cncf.io/container-device-interface,
``pkg/cdi``); docs/cdi-runtimes.md has each rule below with its file and tag. This module holds them
with no I/O, so that the daemon and ``doctor`` can tell, from the spec files of the directories the
runtime reads, whether our names resolve to our specs:

- **Which files**: in each spec directory, the files named ``*.json`` or ``*.yaml`` (not in
  subdirectories), directory by directory in the runtime's order, each directory's files by name; a
  file's *priority* is its directory's index (``spec-dirs.go`` ``scanSpecDirs``).
- **Which load** (``spec.go`` ``ReadSpec``/``validate``, ``device.go``, ``container-edits.go``,
  ``pkg/parser``): strict parsing (an unknown field refuses the file), a known ``cdiVersion`` from
  0.3.0 on, a ``kind`` of a valid vendor and class, valid and distinct device names, devices with
  container edits, device nodes with a path, a known type and permissions of ``rwm`` only, environment
  entries ``NAME=value``. A file that does not load defines no name.
- **Which spec a name resolves to** (``cache.go`` ``refresh``/``resolveConflict``): a spec of a later
  directory replaces an earlier one's device of the same name; two specs of the *same* directory that
  define the same name are a conflict, and the name is then dropped altogether (even if a later
  directory defines it too): creating a container that asks for it fails (``unresolvable CDI devices``).

:func:`problems` says, for our qualified names and our spec files, what is wrong: another file that
defines one of our names (and what that does to it), or a spec of ours that does not load.
"""

from __future__ import annotations

import enum
import json
import posixpath
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

#: The extensions of the files the library reads as specs.
SPEC_EXTENSIONS = (".json", ".yaml")
#: The spec versions the library loads (``cdiVersion``): 0.1.0 and 0.2.0 are known, but every spec
#: must be at least 0.3.0; 1.1.0 is the newest (library v1.1.0).
SPEC_VERSIONS = ("0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0")

_VENDOR_OR_CLASS = re.compile(r"[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?")
_DEVICE_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?")
#: The fields of each object the library knows (specs-go ``config.go``); any other refuses the file.
_SPEC_KEYS = {"cdiVersion", "kind", "annotations", "devices", "containerEdits"}
_DEVICE_KEYS = {"name", "annotations", "containerEdits"}
_EDITS_KEYS = {"env", "deviceNodes", "netDevices", "hooks", "mounts", "intelRdt", "additionalGids"}
_NODE_KEYS = {"path", "hostPath", "type", "major", "minor", "fileMode", "permissions", "uid", "gid"}
_NODE_TYPES = ("", "b", "c", "u", "p")


class SpecError(ValueError):
    """Why the library refuses a spec file."""


class DeviceNode(NamedTuple):
    """One device node a spec gives a container (``deviceNodes``): None where the spec leaves a field out."""

    path: str
    host_path: str = ""
    type: str = ""
    major: int | None = None
    minor: int | None = None
    file_mode: int | None = None
    uid: int | None = None
    gid: int | None = None
    permissions: str = ""


@dataclass(frozen=True)
class LoadedSpec:
    """One spec file as the library reads it: where, at which priority, and the names it defines."""

    path: str
    #: The index of its directory in the runtime's spec directories.
    priority: int
    #: The qualified names it defines (none when it does not load).
    names: tuple[str, ...] = ()
    #: Why the library refuses it ("" when it loads).
    error: str = ""
    #: The device nodes each name gives a container (its device's and the spec's own), as ``names``.
    nodes: tuple[tuple[DeviceNode, ...], ...] = ()

    def nodes_of(self, name: str) -> tuple[DeviceNode, ...]:
        return self.nodes[self.names.index(name)] if name in self.names and self.nodes else ()


def is_spec_file(name: str) -> bool:
    return name.endswith(SPEC_EXTENSIONS)


def load(path: str, priority: int, text: str) -> LoadedSpec:
    """A spec file's text read as the library reads it."""
    try:
        if path.endswith(".yaml"):
            import yaml  # noqa: PLC0415 - PyYAML only where a spec is YAML

            try:
                raw = yaml.safe_load(text)
            except yaml.YAMLError as exc:
                raise SpecError(f"not YAML: {exc}") from None
        else:
            try:
                raw = json.loads(text)
            except ValueError as exc:
                raise SpecError(f"not JSON: {exc}") from None
        found = devices(raw)
        return LoadedSpec(path, priority, tuple(n for n, _ in found), nodes=tuple(nodes for _, nodes in found))
    except SpecError as exc:
        return LoadedSpec(path, priority, error=str(exc))


def qualified_names(raw: object) -> tuple[str, ...]:
    """The names a parsed spec defines (``vendor/class=name``); SpecError where the library refuses it."""
    return tuple(name for name, _ in devices(raw))


def devices(raw: object) -> tuple[tuple[str, tuple[DeviceNode, ...]], ...]:
    """Each name a parsed spec defines, with the device nodes it gives a container (the device's, then the
    spec's own, which the library applies to every device of the spec); SpecError where it is refused."""
    spec = _fields(raw, _SPEC_KEYS, "the spec")
    version = spec.get("cdiVersion")
    if version not in SPEC_VERSIONS:
        raise SpecError(f"cdiVersion {version!r} is not one the library loads ({SPEC_VERSIONS[0]} or later)")
    kind = spec.get("kind")
    vendor, _, klass = kind.partition("/") if isinstance(kind, str) else ("", "", "")
    if not (_VENDOR_OR_CLASS.fullmatch(vendor) and _VENDOR_OR_CLASS.fullmatch(klass)):
        raise SpecError(f"kind {kind!r} is not vendor/class")
    _edits(spec.get("containerEdits"), "the spec's containerEdits")
    found = spec.get("devices")
    if not isinstance(found, list) or not found:
        raise SpecError("no devices")
    names: list[str] = []
    nodes: list[tuple[DeviceNode, ...]] = []
    for raw_device in found:
        device = _fields(raw_device, _DEVICE_KEYS, "a device")
        name = device.get("name")
        if not isinstance(name, str) or not _DEVICE_NAME.fullmatch(name):
            raise SpecError(f"device name {name!r} is not valid")
        if name in names:
            raise SpecError(f"multiple device {name!r}")
        if not _edits(device.get("containerEdits"), f"device {name!r}"):
            raise SpecError(f"device {name!r} has empty containerEdits")
        names.append(name)
        nodes.append(_nodes(device["containerEdits"]) + _nodes(spec.get("containerEdits")))
    return tuple((f"{kind}={name}", given) for name, given in zip(names, nodes, strict=True))


def _nodes(raw: Any) -> tuple[DeviceNode, ...]:
    """The device nodes of container edits the library accepted (``_edits`` checked them)."""
    if not isinstance(raw, dict):
        return ()
    lower = {str(key).lower(): value for key, value in raw.items()}
    out = []
    for node in lower.get("devicenodes") or ():
        fields = {str(key).lower(): value for key, value in node.items()}

        def number(key: str, fields: dict[str, Any] = fields) -> int | None:
            value = fields.get(key)
            return value if isinstance(value, int) and not isinstance(value, bool) else None

        out.append(
            DeviceNode(
                posixpath.normpath(fields["path"]),
                str(fields.get("hostpath") or ""),
                str(fields.get("type") or ""),
                number("major"),
                number("minor"),
                number("filemode"),
                number("uid"),
                number("gid"),
                str(fields.get("permissions") or ""),
            )
        )
    return tuple(out)


def _fields(raw: object, known: set[str], what: str) -> dict[str, Any]:
    """An object with no field the library does not know (its parsing is strict; field names match
    regardless of case, as Go's JSON decoding does)."""
    if not isinstance(raw, dict):
        raise SpecError(f"{what} is not an object")
    lower = {key.lower(): key for key in known}
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if not isinstance(key, str) or key.lower() not in lower:
            raise SpecError(f"{what} has an unknown field {key!r}")
        out[lower[key.lower()]] = value
    return out


def _edits(raw: object, what: str) -> bool:
    """Check container edits as the library does; whether they edit anything."""
    if raw is None:
        return False
    edits = _fields(raw, _EDITS_KEYS, what)
    for entry in edits.get("env") or ():
        if not isinstance(entry, str) or entry.find("=") <= 0:
            raise SpecError(f"{what}: invalid environment variable {entry!r}")
    for raw_node in edits.get("deviceNodes") or ():
        node = _fields(raw_node, _NODE_KEYS, f"{what}: a device node")
        path = node.get("path")
        if not isinstance(path, str) or not path:
            raise SpecError(f"{what}: a device node has no path")
        if node.get("type", "") not in _NODE_TYPES:
            raise SpecError(f"{what}: device {path!r} has invalid type {node.get('type')!r}")
        permissions = node.get("permissions", "")
        if not isinstance(permissions, str) or set(permissions) - set("rwm"):
            raise SpecError(f"{what}: device {path!r} has invalid permissions {permissions!r}")
    return any(edits.get(key) for key in _EDITS_KEYS)


# -- resolving names ---------------------------------------------------------------------------------


def resolve(specs: Sequence[LoadedSpec]) -> dict[str, str | None]:
    """Each qualified name and the path of the spec it resolves to, None where it is dropped as a
    conflict: the library's ``refresh``, given the files in the order it reads them."""
    devices: dict[str, LoadedSpec] = {}
    conflicts: set[str] = set()
    for spec in specs:
        for name in spec.names:
            old = devices.get(name)
            if old is None or spec.priority > old.priority:
                devices[name] = spec
            elif spec.priority == old.priority:
                conflicts.add(name)
    return {name: (None if name in conflicts else spec.path) for name, spec in devices.items()}


class Trouble(enum.Enum):
    """What another spec file does to one of our names, or what is wrong with a spec of ours."""

    #: It and another spec of the same directory (ours, mostly) define our name: the name is dropped,
    #: and no container that asks for it is created.
    CONFLICT = "conflict"
    #: It defines our name from a later directory: containers get its device, not ours.
    REPLACES = "replaces"
    #: It defines our name but ours is used (it is in an earlier directory): harmless until ours goes.
    SHADOWED = "shadowed"
    #: Our spec does not load: our names do not resolve.
    REFUSED = "refused"


@dataclass(frozen=True)
class SpecProblem:
    """One file to act on, and why."""

    path: str
    trouble: Trouble
    #: Our qualified name it is about.
    name: str
    #: Our spec file.
    ours: str
    #: Why the library refuses our spec (REFUSED only).
    error: str = ""
    #: The device nodes its device gives a container instead of ours (REPLACES only).
    nodes: tuple[DeviceNode, ...] = ()

    @property
    def breaks(self) -> bool:
        """Whether containers asking for the name fail or get another device."""
        return self.trouble is not Trouble.SHADOWED

    def describe(self) -> str:
        """One line: ``/etc/cdi/other.json also defines ate.dev/kvm=kvm: the runtime drops the name ...``."""
        if self.trouble is Trouble.REFUSED:
            return f"{self.path}: the CDI library refuses it ({self.error}), so {self.name} does not resolve"
        effect = {
            Trouble.CONFLICT: "two specs of one spec directory define it, so the runtime drops the name and "
            "does not create a container that asks for it (unresolvable CDI devices)",
            Trouble.REPLACES: f"it is in a later spec directory than {self.ours}, so containers get its device",
            Trouble.SHADOWED: f"{self.ours} is used (it is in a later spec directory), but remove it",
        }[self.trouble]
        return f"{self.path} also defines {self.name}: {effect}"

    def remedy(self) -> str:
        if self.trouble is Trouble.REFUSED:
            return (
                f"report the error: {self.path} is ate-devplugd's own spec (a copy changed or broken by anyone "
                "else is written back at once, and on every reload; removing it only brings it back)"
            )
        return f"remove {self.path}, or rename it to end in neither .json nor .yaml, or give its kind another name"


def problems(specs: Sequence[LoadedSpec], ours: Mapping[str, Sequence[str]]) -> list[SpecProblem]:
    """What stops our names from resolving to our specs, per file, in the order the files are read.
    ``ours``: each of our qualified names with the paths our spec has in ``specs`` (more than one where
    the runtime reads our directory twice, under two names: the same file, which is no conflict). A name
    whose spec of ours is not among ``specs`` has none here: that ours is missing is its problem."""
    resolved = resolve(specs)
    out: list[SpecProblem] = []
    for name, paths in ours.items():
        if not any(spec.path in paths for spec in specs):
            continue  # ours is not on disk (yet): another spec's effect on our name is told once it is
        our_path = paths[-1] if paths else ""
        refused = next((spec for spec in specs if spec.path in paths and spec.error), None)
        if refused is not None:
            out.append(SpecProblem(refused.path, Trouble.REFUSED, name, refused.path, refused.error))
        winner = resolved.get(name)
        for spec in specs:
            if spec.path in paths or name not in spec.names:
                continue
            if winner is None:
                trouble = Trouble.CONFLICT
            elif winner == spec.path:
                trouble = Trouble.REPLACES
            elif winner in paths:
                trouble = Trouble.SHADOWED
            else:
                continue  # a third file's device wins: that file is the one reported
            nodes = spec.nodes_of(name) if trouble is Trouble.REPLACES else ()
            out.append(SpecProblem(spec.path, trouble, name, our_path, nodes=nodes))
    return out
