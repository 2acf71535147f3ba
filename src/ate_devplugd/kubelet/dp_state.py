"""kubelet's device-manager checkpoint, ``<plugin_dir>/kubelet_internal_checkpoint``: the healthy units it
recorded for each resource at its last write, and which write that was.

kubelet's device manager rewrites the file (a dot-named temp file renamed into place, so a new inode) each
time it takes in a ListAndWatch message of any plugin (``genericDeviceUpdateCallback``) and after an
allocation; ``Data.RegisteredDevices`` then maps each resource name to the IDs of its healthy set. It does
not write it when it disconnects a client (``PluginDisconnected`` only marks the units unhealthy). DRA mode's
withheld device-plugin path serves every unit Unhealthy, so a write made while kubelet holds it shows no ID
for the name: any ID there, in a write made after our Register, was sent by another client for the name
(``deviceplugin.offer``). The file is kubelet's, not an API: what cannot be read or parsed tells nothing.
"""

from __future__ import annotations

import os
import posixpath
from typing import NamedTuple

from ate_devplugd.base.unixsock import FileIdentity

CHECKPOINT = "kubelet_internal_checkpoint"
#: Larger than any node's checkpoint (pods' allocations included); a longer file is not read.
_LIMIT = 16 << 20


class Recorded(NamedTuple):
    """One write of the checkpoint: which file it is, and the healthy IDs it records per resource."""

    identity: FileIdentity
    healthy: dict[str, frozenset[str]]


def identity(plugin_dir: str) -> FileIdentity | None:
    """Which write of the checkpoint is there now (None: none, or it cannot be looked at)."""
    try:
        st = os.stat(posixpath.join(plugin_dir, CHECKPOINT))
    except OSError:
        return None
    return FileIdentity(st.st_dev, st.st_ino, st.st_ctime_ns)


def recorded(plugin_dir: str) -> Recorded | None:
    """The checkpoint as kubelet last wrote it; None when there is none or it cannot be read or parsed."""
    import json  # noqa: PLC0415 - only where the checkpoint is read (DRA mode's withheld path)

    try:
        with open(posixpath.join(plugin_dir, CHECKPOINT), "rb") as fh:
            st = os.fstat(fh.fileno())
            text = fh.read(_LIMIT + 1)
        doc = json.loads(text) if len(text) <= _LIMIT else None
    except (OSError, ValueError):
        return None
    data = doc.get("Data") if isinstance(doc, dict) else None
    devices = data.get("RegisteredDevices") if isinstance(data, dict) else None
    if not isinstance(devices, dict):
        return None
    healthy = {
        str(name): frozenset(str(i) for i in ids) for name, ids in devices.items() if isinstance(ids, list | tuple)
    }
    return Recorded(FileIdentity(st.st_dev, st.st_ino, st.st_ctime_ns), healthy)
