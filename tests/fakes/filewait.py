"""Wake up when a file in a directory is created or written (inotify, standard library only).

The package and VM tests wait on the fake kubelet's JSON-lines log with it. A wake-up is a hint to
read again, never a record: readers watch first, then read, then wait, so no write is missed between
a read and the wait.
"""

from __future__ import annotations

import ctypes
import os
import select
from types import TracebackType

IN_MODIFY = 0x00000002
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100


class DirWatch:
    """inotify on one directory: files created, written or renamed into it."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        if libc.inotify_add_watch(fd, os.fsencode(directory), IN_MODIFY | IN_CREATE | IN_MOVED_TO) < 0:
            err = ctypes.get_errno()
            os.close(fd)
            raise OSError(err, f"cannot watch {os.fsdecode(directory)}: {os.strerror(err)}")
        self.fd = fd

    def wait(self, timeout: float) -> bool:
        """Until something changed in the directory (True) or ``timeout`` seconds passed (False)."""
        if timeout <= 0 or not select.select([self.fd], [], [], timeout)[0]:
            return False
        try:
            while os.read(self.fd, 65536):
                pass
        except BlockingIOError:
            pass
        return True

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> DirWatch:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
