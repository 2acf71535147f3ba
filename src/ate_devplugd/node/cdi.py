"""CDI specs: the node a container gets, with the owner and mode it has inside the container.

For a ``[[device]]`` table with ``cdi = true`` the daemon writes one CDI spec (kind = the resource name,
one device named after the node, ``ate.dev/kvm=kvm``) into ``cdi_dir``, and Allocate names that device
beside its DeviceSpec. A runtime with CDI on (containerd >= 1.7 with ``enable_cdi``, CRI-O, podman)
applies the spec's device node: it replaces the runtime's own entry for the same path, so the container
sees the node once, with ``fileMode``/``uid``/``gid`` from the spec; the host's node is untouched and
the cgroup rule still grants only this device. A runtime with CDI off ignores the name, and the
DeviceSpec grants the node with the host's owner and mode, as without CDI.

The spec is written before the resource is first served (the registry looks at the device, then this
writer runs, all before the session can register), atomically (a hidden temp file renamed into
place), and again when the node's major:minor or the table changes. It heals itself: ``cdi_dir`` is
followed with inotify (on the loop, ``DirWatcher``), and a spec of ours removed, changed or made invalid
on disk (or its whole directory removed) is written back ``SETTLE_DELAY`` after the first event of a
burst, as is one found so at any look (every reload looks); each such rewrite is one warning
(``cdi-spec-restored``, saying what had happened to it) and one count (``on_restored``). ``state`` says
cheaply whether a resource's spec is on disk and ours. It stays while the daemon is stopped or
restarting: kubelet replays the checkpointed CDI names when a container restarts, and a
runtime refuses a name whose spec is missing ("unresolvable CDI devices"). It is removed only when
its resource leaves the config or stops using CDI.

A spec that cannot be written (a read-only or missing directory that cannot be made) is logged once;
the resource is then granted without CDI until a reload, never failing registration or Allocate.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import posixpath
from collections.abc import Callable
from typing import Any

from ate_devplugd.base import atomicfile
from ate_devplugd.base.inotify import DirEvent, DirWatcher, watch_dir
from ate_devplugd.base.logs import EventLog
from ate_devplugd.config.device import DeviceConfig, qualified_name
from ate_devplugd.node.devices import Resource

log = logging.getLogger(__name__)

#: The lowest version carrying every field written: deviceNodes with fileMode, uid and gid are in the
#: spec from 0.3.0 on (container-device-interface specs-go v0.3.0). podman 4.3.1 reads 0.1.0 to 0.5.0,
#: and libraries from v0.5.4 on refuse anything below 0.3.0.
CDI_VERSION = "0.3.0"
SPEC_MODE = 0o644
#: How long after the first event in ``cdi_dir`` our specs are looked at again (a tool removing or
#: writing several files is one look).
SETTLE_DELAY = 0.05
#: Journal event: a spec of ours found removed, changed or invalid on disk, and written back.
EVENT_RESTORED = "cdi-spec-restored"


class SpecState(enum.Enum):
    """What is on disk at a resource's spec path, against what the daemon wrote there."""

    OURS = "ours"
    REMOVED = "removed"
    CHANGED = "changed"
    INVALID = "invalid"
    #: No spec is kept for the resource: it does not use CDI, its device was never seen, or the spec
    #: could not be written (it is then granted without CDI until a reload).
    NOT_WRITTEN = "not written"


#: What a rewrite says had happened to the spec.
_HAPPENED = {
    SpecState.REMOVED: "was removed",
    SpecState.CHANGED: "was changed (not what the daemon wrote)",
    SpecState.INVALID: "was made invalid (not a CDI spec a runtime can load)",
}


def spec_path(cdi_dir: str, dev: DeviceConfig) -> str:
    """``<cdi_dir>/<vendor>-<class>.json``, as CDI's own tools name a vendor's spec for a class."""
    return posixpath.join(cdi_dir, dev.resource.replace("/", "-") + ".json")


def spec(dev: DeviceConfig, major: int, minor: int) -> dict[str, Any]:
    """The spec for ``dev`` whose host node is char ``major:minor``: every field written, none left to guess.

    Type and numbers are given so no runtime needs to stat the host node; permissions so the cgroup rule
    is exactly the configured one (CDI's default is ``rwm``); fileMode so the mode does not depend on the
    runtime (runc's default is 0666, CDI >= 1.1.0 copies the host's). uid/gid are written only when
    configured: left out, a runtime gives the node to the container's user when it is not root.
    """
    node: dict[str, Any] = {
        "path": dev.path,
        "type": "c",
        "major": major,
        "minor": minor,
        "permissions": dev.permissions,
        "fileMode": dev.node_mode,
    }
    if dev.container_uid is not None:
        node["uid"] = dev.container_uid
    if dev.container_gid is not None:
        node["gid"] = dev.container_gid
    return {
        "cdiVersion": CDI_VERSION,
        "kind": dev.resource,
        "devices": [{"name": dev.cdi_name, "containerEdits": {"deviceNodes": [node]}}],
    }


class CdiSpecs:
    """Keeps each CDI-enabled resource's spec true to its node and its table, and Allocate's name with it;
    puts a spec back that someone else removed, changed or broke (see the module's docstring)."""

    def __init__(self, cdi_dir: str, on_restored: Callable[[str], None] | None = None) -> None:
        self.cdi_dir = cdi_dir
        self._on_restored = on_restored
        #: The files written, by resource name: the path and its content; and the resources themselves.
        self._written: dict[str, tuple[str, bytes]] = {}
        self._resources: dict[str, Resource] = {}
        #: Resources whose spec could not be written: granted without CDI until a reload.
        self._failed: set[str] = set()
        self._watcher: DirWatcher | None = None
        self._settle: asyncio.TimerHandle | None = None

    def state(self, name: str) -> SpecState:
        """Whether resource ``name``'s spec is on disk and ours now (one read of a small file)."""
        written = self._written.get(name)
        return SpecState.NOT_WRITTEN if written is None else on_disk(*written)

    def sync(self, resource: Resource) -> None:
        """After each look at a device: write its spec if it needs CDI and the spec on disk is not current."""
        dev = resource.config
        devnum = resource.presence.devnum
        if not dev.cdi or resource.name in self._failed:
            resource.cdi_device = None
            return
        if devnum is None:
            # Not there now: the spec written while it was (if any) stays for the containers holding it.
            return
        import json  # noqa: PLC0415 - only once a device uses CDI

        path = spec_path(self.cdi_dir, dev)
        data = (json.dumps(spec(dev, *devnum), indent=2) + "\n").encode()
        found = on_disk(path, data)
        if found is SpecState.OURS:
            self._keep(resource, path, data)
            return
        healed = found if self._written.get(resource.name) == (path, data) else None
        if self._write(resource, path, data, healed) and healed is None:
            resource.events.info(
                "cdi-spec",
                "wrote the CDI spec %s: %s is %s %d:%d, mode %04o in the container",
                path,
                qualified_name(dev),
                dev.path,
                *devnum,
                dev.node_mode,
            )

    def apply(self, cdi_dir: str, devices: tuple[DeviceConfig, ...]) -> None:
        """A reload: remove the specs of resources gone or no longer using CDI; retry the failed ones;
        follow ``cdi_dir`` while a resource uses CDI (before any look writes a spec)."""
        keep = {dev.resource for dev in devices if dev.cdi and cdi_dir == self.cdi_dir}
        for name, (path, _) in list(self._written.items()):
            if name not in keep:
                self._remove(path)
                del self._written[name]
                self._resources.pop(name, None)
        self.cdi_dir = cdi_dir
        self._failed.clear()
        self._follow(any(dev.cdi for dev in devices))

    def close(self) -> None:
        self._follow(False)

    # -- writing -----------------------------------------------------------------------------------
    def _keep(self, resource: Resource, path: str, data: bytes) -> None:
        self._written[resource.name] = (path, data)
        self._resources[resource.name] = resource
        resource.cdi_device = qualified_name(resource.config)

    def _write(self, resource: Resource, path: str, data: bytes, healed: SpecState | None) -> bool:
        """Write the spec (its directory made again where it is gone); ``healed``: what had happened to
        the one written before, said and counted. False when it cannot be written."""
        directory_gone = not os.path.isdir(self.cdi_dir)
        try:
            os.makedirs(self.cdi_dir, mode=0o755, exist_ok=True)
            atomicfile.replace_file(path, data, SPEC_MODE)
        except OSError as exc:
            self._failed.add(resource.name)
            self._written.pop(resource.name, None)
            self._resources.pop(resource.name, None)
            resource.cdi_device = None
            resource.events.warning(
                "cdi-failed",
                "cannot write the CDI spec %s: %s; %s is granted without CDI (the node with the host's "
                "owner and mode) until a reload",
                path,
                exc.strerror or exc,
                resource.name,
            )
            return False
        self._keep(resource, path, data)
        if healed is not None:
            if self._on_restored is not None:
                self._on_restored(resource.name)
            resource.events.warning(
                EVENT_RESTORED,
                "the CDI spec %s of %s %s%s; wrote it back",
                path,
                resource.name,
                _HAPPENED.get(healed, healed.value),
                f" with its directory {self.cdi_dir}, made again" if directory_gone else "",
            )
        return True

    @staticmethod
    def _remove(path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        except OSError as exc:
            EventLog(log).warning("cdi-failed", "cannot remove the CDI spec %s: %s", path, exc.strerror or exc)
            return
        EventLog(log).info("cdi-spec-removed", "removed the CDI spec %s", path)

    # -- following cdi_dir -------------------------------------------------------------------------
    def _follow(self, wanted: bool) -> None:
        """Watch ``cdi_dir`` (kept when it is the one watched), or stop watching."""
        watcher = self._watcher
        if watcher is not None and wanted and watcher.path == posixpath.normpath(self.cdi_dir):
            return
        if self._settle is not None:
            self._settle.cancel()
            self._settle = None
        if watcher is not None:
            watcher.close()
            self._watcher = None
        if not wanted:
            return
        self._watcher = watch_dir(self.cdi_dir, self._on_events, self._unwatched, contents=True)

    def _unwatched(self, exc: OSError) -> None:
        EventLog(log).warning(
            "cdi-unwatched",
            "cdi: cannot watch %s for our specs (%s); a spec of ours removed or changed there is written back "
            "only at the next look (udev event or reload)",
            self.cdi_dir,
            exc.strerror or exc,
        )

    def _on_events(self, events: list[DirEvent]) -> None:
        names = {posixpath.basename(path) for path, _ in self._written.values()}
        if not any(ev.name in names or not ev.name for ev in events):
            return
        if self._settle is None:
            self._settle = asyncio.get_running_loop().call_later(SETTLE_DELAY, self._heal)

    def _heal(self) -> None:
        """Every spec of ours not on disk as written: written back."""
        self._settle = None
        for name, (path, data) in list(self._written.items()):
            found = on_disk(path, data)
            resource = self._resources.get(name)
            if found is not SpecState.OURS and resource is not None:
                self._write(resource, path, data, found)


def on_disk(path: str, data: bytes) -> SpecState:
    """What ``path`` holds against ``data`` (what was written there): ours, removed, changed or invalid."""
    try:
        with open(path, "rb") as fh:
            found = fh.read(max(len(data) + 1, 1 << 20))
    except (FileNotFoundError, NotADirectoryError):
        return SpecState.REMOVED
    except OSError:
        return SpecState.INVALID
    if found == data:
        return SpecState.OURS
    import json  # noqa: PLC0415 - only once a device uses CDI

    try:
        loaded = json.loads(found)
    except (ValueError, UnicodeDecodeError):
        return SpecState.INVALID
    ok = isinstance(loaded, dict) and isinstance(loaded.get("kind"), str) and isinstance(loaded.get("devices"), list)
    return SpecState.CHANGED if ok else SpecState.INVALID
