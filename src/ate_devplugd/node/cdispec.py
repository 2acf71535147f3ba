"""A CDI spec of ours: where it goes, what it says, and whether it is on disk as written (no state kept).

``spec`` is the one device node a container gets for a ``[[device]]`` table with ``cdi = true``, with
every field written; ``spec_path`` names its file in ``cdi_dir``; ``on_disk`` compares the file there
with what was written (``SpecState``). ``node.cdi`` writes the specs and keeps them; ``cri`` reads where
they are.
"""

from __future__ import annotations

import enum
import posixpath
from typing import Any

from ate_devplugd.config.device import DeviceConfig

#: The lowest version carrying every field written: deviceNodes with fileMode, uid and gid are in the
#: spec from 0.3.0 on (container-device-interface specs-go v0.3.0). podman 4.3.1 reads 0.1.0 to 0.5.0,
#: and libraries from v0.5.4 on refuse anything below 0.3.0.
CDI_VERSION = "0.3.0"
SPEC_MODE = 0o644


class SpecState(enum.Enum):
    """What is on disk at a resource's spec path, against what the daemon wrote there."""

    OURS = "ours"
    REMOVED = "removed"
    CHANGED = "changed"
    INVALID = "invalid"
    #: No spec is kept for the resource: it does not use CDI, its device was never seen, or the spec
    #: cannot be written now (``CdiSpecs.failure`` says why).
    NOT_WRITTEN = "not written"


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
