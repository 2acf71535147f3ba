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
on disk (or its whole directory removed) is written back at once, in the callback of the event that
told, as is one found so at any look (every reload looks); each such rewrite is one warning
(``cdi-spec-restored``, saying what had happened to it) and one count (``on_restored``). It stays while
the daemon is stopped or restarting: kubelet replays the checkpointed CDI names when a container
restarts, and a runtime refuses a name whose spec is missing ("unresolvable CDI devices"). It is
removed only when its resource leaves the config or stops using CDI.

A spec that cannot be written (a full filesystem, a file at ``cdi_dir``, a read-only directory) is
logged once per cause (``cdi-failed``) and tried again on every event in ``cdi_dir`` and on a back-off
(``RETRY_FIRST`` doubling to ``RETRY_CAP``): ``failure`` says why meanwhile, Allocate names no CDI device,
and ``cri.usable`` withholds the device wherever its VMM needs the spec (``spec-missing``). ``cdi_dir``
renamed away (``mv``, or swapped for another by two renames) is ``moved``: a runtime's CDI cache follows
the directory it watched to where it went (``cri.usable`` withholds until the runtime restarts).
``state``, ``failure`` and ``moved`` are cheap to ask.
"""

from __future__ import annotations

import asyncio
import logging
import os
import posixpath
from collections.abc import Callable
from typing import NamedTuple

from ate_devplugd.base import atomicfile
from ate_devplugd.base.backoff import Backoff
from ate_devplugd.base.inotify import DirEvent, DirWatcher, watch_dir
from ate_devplugd.base.logs import EventLog
from ate_devplugd.config.device import DeviceConfig, qualified_name
from ate_devplugd.node.cdispec import SPEC_MODE, SpecState, on_disk, spec, spec_path
from ate_devplugd.node.devices import Resource

log = logging.getLogger(__name__)

#: A spec that cannot be written is tried again after ``RETRY_FIRST`` seconds, the delays doubling up to
#: ``RETRY_CAP`` while it fails (and at once on each event in ``cdi_dir``): no event says when a full
#: filesystem has room again.
RETRY_FIRST = 0.1
RETRY_CAP = 2.0
#: Journal events: a spec of ours found removed, changed or invalid on disk, and written back; ``cdi_dir``
#: replaced (renamed away).
EVENT_RESTORED = "cdi-spec-restored"
EVENT_REPLACED = "cdi-dir-replaced"


#: What a rewrite says had happened to the spec.
_HAPPENED = {
    SpecState.REMOVED: "was removed",
    SpecState.CHANGED: "was changed (not what the daemon wrote)",
    SpecState.INVALID: "was made invalid (not a CDI spec a runtime can load)",
}


class DirMove(NamedTuple):
    """``cdi_dir`` renamed away while followed: when (the loop's time), in words, and which directory went."""

    at: float
    detail: str
    identity: tuple[int, int] | None


class CdiSpecs:
    """Keeps each CDI-enabled resource's spec true to its node and its table, and Allocate's name with it;
    puts a spec back that someone else removed, changed or broke, and keeps trying one that cannot be
    written (see the module's docstring). ``on_change`` hears a resource whose spec was written back, could
    not be, or whose directory was replaced, outside a look (a look's owner hears it anyway)."""

    def __init__(
        self,
        cdi_dir: str,
        on_restored: Callable[[str], None] | None = None,
        on_change: Callable[[Resource], None] | None = None,
    ) -> None:
        self.cdi_dir = cdi_dir
        self._on_restored = on_restored
        self._on_change = on_change
        #: The files to keep on disk, by resource name: the path and its content; and the resources themselves.
        self._written: dict[str, tuple[str, bytes]] = {}
        self._resources: dict[str, Resource] = {}
        #: Resources whose spec cannot be written now, and why: tried again on events and a back-off; and
        #: what had happened to the one written before, where a heal failed (said once it is written back).
        self._failed: dict[str, str] = {}
        self._harmed: dict[str, SpecState] = {}
        self._retry: asyncio.TimerHandle | None = None
        self._backoff = Backoff(RETRY_FIRST, RETRY_CAP)
        self._watcher: DirWatcher | None = None
        #: ``cdi_dir``'s identity (device, inode) when last written in, and its last move away.
        self._identity: tuple[int, int] | None = None
        self._moved: DirMove | None = None

    def state(self, name: str) -> SpecState:
        """Whether resource ``name``'s spec is on disk and ours now (one read of a small file)."""
        written = self._written.get(name)
        return SpecState.NOT_WRITTEN if written is None or name in self._failed else on_disk(*written)

    def failure(self, name: str) -> str:
        """Why resource ``name``'s spec cannot be written now ("" when it can)."""
        return self._failed.get(name, "")

    @property
    def moved(self) -> DirMove | None:
        """``cdi_dir``'s last move away while followed (None when it is the directory it was, or none moved)."""
        return self._moved

    def sync(self, resource: Resource) -> None:
        """After each look at a device: write its spec if it needs CDI and the spec on disk is not current."""
        dev = resource.config
        devnum = resource.presence.devnum
        if not dev.cdi:
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
        failed = resource.name in self._failed
        healed: SpecState | None = found if self._written.get(resource.name) == (path, data) else None
        healed = self._harmed.get(resource.name) if failed else healed
        if self._write(resource, path, data, healed) and healed is None and not failed:
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
        """A reload: remove the specs of resources gone or no longer using CDI; follow ``cdi_dir`` while a
        resource uses CDI (before any look writes a spec)."""
        keep = {dev.resource for dev in devices if dev.cdi and cdi_dir == self.cdi_dir}
        for name, (path, _) in list(self._written.items()):
            if name not in keep:
                if name not in self._failed:
                    self._remove(path)
                del self._written[name]
                self._resources.pop(name, None)
                self._failed.pop(name, None)
                self._harmed.pop(name, None)
        if cdi_dir != self.cdi_dir:
            self._identity = self._moved = None
        self.cdi_dir = cdi_dir
        self._follow(any(dev.cdi for dev in devices))

    def close(self) -> None:
        self._follow(False)

    # -- writing -----------------------------------------------------------------------------------
    def _keep(self, resource: Resource, path: str, data: bytes) -> None:
        self._written[resource.name] = (path, data)
        self._resources[resource.name] = resource
        self._failed.pop(resource.name, None)
        self._harmed.pop(resource.name, None)
        resource.cdi_device = qualified_name(resource.config)
        self._identity = _identity(self.cdi_dir)
        if self._moved is not None and self._identity == self._moved.identity:
            self._moved = None  # moved back: the directory the runtime follows is ours again

    def _write(self, resource: Resource, path: str, data: bytes, healed: SpecState | None) -> bool:
        """Write the spec (its directory made again where it is gone); ``healed``: what had happened to
        the one written before, said and counted. False when it cannot be written: it is kept to write, and
        tried again on the directory's events and a back-off."""
        directory_gone = not os.path.isdir(self.cdi_dir)
        try:
            os.makedirs(self.cdi_dir, mode=0o755, exist_ok=True)
            atomicfile.replace_file(path, data, SPEC_MODE)
        except OSError as exc:
            cause = self._cause(path, exc)
            self._written[resource.name] = (path, data)
            self._resources[resource.name] = resource
            resource.cdi_device = None
            if self._failed.get(resource.name) != cause:
                resource.events.warning(
                    "cdi-failed",
                    "%s; %s is not offered where its VMM needs the spec (spec-missing), and never granted "
                    "with a spec that is not there; tried again on each change in %s and after %g s, doubling "
                    "to %g s",
                    cause,
                    resource.name,
                    self.cdi_dir,
                    RETRY_FIRST,
                    RETRY_CAP,
                )
            self._failed[resource.name] = cause
            if healed is not None:
                self._harmed[resource.name] = healed
            self._retry_later()
            return False
        failed = self._failed.get(resource.name)
        self._keep(resource, path, data)
        if failed and healed is None:
            resource.events.info("cdi-spec", "wrote the CDI spec %s (it could not be written before: %s)", path, failed)
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

    def _cause(self, path: str, exc: OSError) -> str:
        if os.path.lexists(self.cdi_dir) and not os.path.isdir(self.cdi_dir):
            return f"cannot write the CDI spec {path}: {self.cdi_dir} is not a directory"
        return f"cannot write the CDI spec {path}: {exc.strerror or exc}"

    def _retry_later(self) -> None:
        if self._retry is None:
            self._retry = asyncio.get_running_loop().call_later(self._backoff.next(), self._retried)

    def _retried(self) -> None:
        self._retry = None
        self._heal()
        if not self._failed:
            self._backoff.reset()

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
        if self._retry is not None and not wanted:
            self._retry.cancel()
            self._retry = None
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
        if any(ev.kind == "dir-gone" and ev.moved for ev in events) and self._written:
            # Renamed away: a runtime's CDI cache that watched it follows it there (cri.usable).
            what = f"{self.cdi_dir} was replaced (renamed away)"
            self._moved = DirMove(asyncio.get_running_loop().time(), what, self._identity)
            EventLog(log).warning(EVENT_REPLACED, "cdi: %s; writing our specs into a new %s", what, self.cdi_dir)
            self._heal(changed=set(self._resources))
            return
        names = {posixpath.basename(path) for path, _ in self._written.values()}
        if self._failed or any(ev.name in names or not ev.name for ev in events):
            self._heal()

    def _heal(self, changed: set[str] | None = None) -> None:
        """Every spec of ours not on disk as written: written back at once (by rename, as every write).
        ``on_change`` then hears each resource whose spec was not there, and those in ``changed``."""
        changed = set(changed or ())
        for name, (path, data) in list(self._written.items()):
            found = self._harmed.get(name, SpecState.NOT_WRITTEN) if name in self._failed else on_disk(path, data)
            resource = self._resources.get(name)
            if found is not SpecState.OURS and resource is not None:
                self._write(resource, path, data, None if found is SpecState.NOT_WRITTEN else found)
                changed.add(name)
        if self._on_change is not None:
            for name in changed:
                if name in self._resources:
                    self._on_change(self._resources[name])


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino
