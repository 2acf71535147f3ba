"""Replace a file in one step: readers see the old content or the new, never part of either."""

from __future__ import annotations

import contextlib
import os
import posixpath


def temp_path(path: str) -> str:
    """The hidden name next to ``path`` its new content is written under (no reader's pattern matches it)."""
    directory, base = posixpath.split(path)
    return posixpath.join(directory, f".{base}.tmp")


def replace_file(path: str, data: bytes, mode: int) -> None:
    """Write ``data`` to a temp file in the same directory with ``mode`` (whatever the umask), then rename
    it over ``path``. No fsync: the daemon writes only files it rebuilds from live state at each start,
    and a disk flush would stall its one loop. A temp file left by a process that died mid-write is
    replaced, never opened (O_EXCL, O_NOFOLLOW: not even through a symlink someone left there)."""
    tmp = temp_path(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(tmp, flags, mode)
    except FileExistsError:
        os.unlink(tmp)
        fd = os.open(tmp, flags, mode)
    try:
        try:
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
