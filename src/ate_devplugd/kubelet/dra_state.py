"""kubelet's DRA manager checkpoint, ``<kubelet_dir>/dra_manager_state``: whether kubelet still records a
claim prepared on this node by a driver, so that unprepare is still owed to it (kubelet's
``pkg/kubelet/cm/dra/manager.go``: unprepare needs the driver registered; docs/switching.md).

Read as text, not parsed: the file is kubelet's, its layout versioned by kubelet; the driver's name in it
is what matters (its claim entries carry it), and a name that is absent is a claim that is not there.
"""

from __future__ import annotations

import enum
import errno
import posixpath

CHECKPOINT = "dra_manager_state"
#: Large enough for any node's claims; a longer file is read no further (and counts as naming the driver).
_LIMIT = 1 << 20


class Claims(enum.Enum):
    """What kubelet's checkpoint says of one driver's claims on this node."""

    #: The checkpoint names the driver: a claim of it may be left to unprepare.
    RECORDED = "recorded"
    #: No checkpoint, or one that does not name the driver: nothing of it is left.
    NONE = "none"
    #: It could not be read (permission, an I/O error): nothing can be told.
    UNKNOWN = "unknown"


def claims_of(kubelet_dir: str, driver: str) -> Claims:
    path = posixpath.join(kubelet_dir, CHECKPOINT)
    try:
        with open(path, "rb") as fh:
            text = fh.read(_LIMIT + 1)
    except OSError as exc:
        return Claims.NONE if exc.errno in (errno.ENOENT, errno.ENOTDIR) else Claims.UNKNOWN
    if len(text) > _LIMIT or driver.encode() in text:
        return Claims.RECORDED
    return Claims.NONE
