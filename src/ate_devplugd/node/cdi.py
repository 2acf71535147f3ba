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
place), and again when the node's major:minor or the table changes. It stays while the daemon is
stopped or restarting: kubelet replays the checkpointed CDI names when a container restarts, and a
runtime refuses a name whose spec is missing ("unresolvable CDI devices"). It is removed only when
its resource leaves the config or stops using CDI.

A spec that cannot be written (a read-only or missing directory that cannot be made) is logged once;
the resource is then granted without CDI until a reload, never failing registration or Allocate.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
from typing import Any

from ate_devplugd.base import atomicfile
from ate_devplugd.base.logs import EventLog
from ate_devplugd.config.device import DeviceConfig, qualified_name
from ate_devplugd.node.devices import Resource

log = logging.getLogger(__name__)

#: The lowest version carrying every field written: deviceNodes with fileMode, uid and gid are in the
#: spec from 0.3.0 on (container-device-interface specs-go v0.3.0). podman 4.3.1 reads 0.1.0 to 0.5.0,
#: and libraries from v0.5.4 on refuse anything below 0.3.0.
CDI_VERSION = "0.3.0"
SPEC_MODE = 0o644


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
    """Keeps each CDI-enabled resource's spec true to its node and its table, and Allocate's name with it."""

    def __init__(self, cdi_dir: str) -> None:
        self.cdi_dir = cdi_dir
        #: The files written, by resource name: the path and its content.
        self._written: dict[str, tuple[str, bytes]] = {}
        #: Resources whose spec could not be written: granted without CDI until a reload.
        self._failed: set[str] = set()

    def sync(self, resource: Resource) -> None:
        """After each look at a device: write its spec if it needs CDI and the spec is not current."""
        dev = resource.config
        devnum = resource.presence.devnum
        if not dev.cdi or resource.name in self._failed:
            resource.cdi_device = None
            return
        if devnum is None:
            # Not there now: the spec written while it was (if any) stays for the containers holding it.
            return
        path = spec_path(self.cdi_dir, dev)
        data = (json.dumps(spec(dev, *devnum), indent=2) + "\n").encode()
        if self._written.get(resource.name) == (path, data) or _holds(path, data):
            self._written[resource.name] = (path, data)
            resource.cdi_device = qualified_name(dev)
            return
        try:
            os.makedirs(self.cdi_dir, mode=0o755, exist_ok=True)
            atomicfile.replace_file(path, data, SPEC_MODE)
        except OSError as exc:
            self._failed.add(resource.name)
            resource.cdi_device = None
            resource.events.warning(
                "cdi-failed",
                "cannot write the CDI spec %s: %s; %s is granted without CDI (the node with the host's "
                "owner and mode) until a reload",
                path,
                exc.strerror or exc,
                resource.name,
            )
            return
        self._written[resource.name] = (path, data)
        resource.cdi_device = qualified_name(dev)
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
        """A reload: remove the specs of resources gone or no longer using CDI; retry the failed ones."""
        keep = {dev.resource for dev in devices if dev.cdi and cdi_dir == self.cdi_dir}
        for name, (path, _) in list(self._written.items()):
            if name not in keep:
                self._remove(path)
                del self._written[name]
        self.cdi_dir = cdi_dir
        self._failed.clear()

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


def _holds(path: str, data: bytes) -> bool:
    """Whether ``path`` already holds exactly ``data`` (a restarted daemon leaves a current spec alone)."""
    try:
        with open(path, "rb") as fh:
            return fh.read(len(data) + 1) == data
    except OSError:
        return False
