"""Wake up when a file in a directory is created or written (inotify, standard library only).

The package and VM tests wait on the fake kubelet's JSON-lines log with it. A wake-up is a hint to
read again, never a record: readers watch first, then read, then wait, so no write is missed between
a read and the wait.
"""

from __future__ import annotations

import ctypes
import os
import select
import struct
from types import TracebackType

IN_MODIFY = 0x00000002
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len; then the name


class DirWatch:
    """inotify on one directory: files created, written or renamed into it (or the events in ``mask``)."""

    def __init__(self, directory: str | os.PathLike[str], mask: int = IN_MODIFY | IN_CREATE | IN_MOVED_TO) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        if libc.inotify_add_watch(fd, os.fsencode(directory), mask) < 0:
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

    def events(self) -> list[tuple[int, str]]:
        """The events queued now: (mask, file name) each."""
        out = []
        try:
            while data := os.read(self.fd, 65536):
                offset = 0
                while offset < len(data):
                    _wd, mask, _cookie, size = _EVENT.unpack_from(data, offset)
                    offset += _EVENT.size
                    out.append((mask, data[offset : offset + size].rstrip(b"\0").decode()))
                    offset += size
        except BlockingIOError:
            pass
        return out

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
