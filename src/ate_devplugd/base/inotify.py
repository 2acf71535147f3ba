"""A small inotify watch on one directory, on the asyncio loop (no thread, no polling).

It reports names created or removed in the directory (and, if asked, files written and closed), and
follows the directory itself: if it is removed, the nearest existing ancestor is watched until the
directory is back, and the owner is told both times. Events are hints: the owner re-reads the state it
cares about.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import logging
import os
import posixpath
import struct
from collections.abc import Callable
from typing import NamedTuple

log = logging.getLogger(__name__)

IN_MODIFY = 0x00000002
IN_ATTRIB = 0x00000004
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_UNMOUNT = 0x00002000
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC

_DIR_MASK = IN_CREATE | IN_MOVED_TO | IN_DELETE | IN_MOVED_FROM | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR
_ANCESTOR_MASK = IN_CREATE | IN_MOVED_TO | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR
_EVENT = struct.Struct("iIII")


class DirEvent(NamedTuple):
    """Something happened in or to the watched directory.

    ``kind`` is ``created``, ``removed`` or ``written`` (with ``name``; ``written``: a file opened for
    writing was closed, reported only to a watcher made with ``contents=True``), ``dir-gone``,
    ``dir-back`` or ``overflow`` (events were lost: re-read everything). ``moved``: a ``dir-gone`` whose
    directory was renamed away (it lives on elsewhere: a watch on it would follow it there), not removed.
    """

    kind: str
    name: str = ""
    moved: bool = False


class _Libc:
    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.init1 = libc.inotify_init1
        self.init1.argtypes = [ctypes.c_int]
        self.init1.restype = ctypes.c_int
        self.add_watch = libc.inotify_add_watch
        self.add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        self.add_watch.restype = ctypes.c_int
        self.rm_watch = libc.inotify_rm_watch
        self.rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
        self.rm_watch.restype = ctypes.c_int


_libc: _Libc | None = None


def _lib() -> _Libc:
    global _libc  # noqa: PLW0603 - one ctypes binding per process, created on first use
    if _libc is None:
        _libc = _Libc()
    return _libc


def watch_dir(
    path: str,
    callback: Callable[[list[DirEvent]], None],
    unwatched: Callable[[OSError], None],
    *,
    contents: bool = False,
) -> DirWatcher | None:
    """A started ``DirWatcher`` on ``path``; None when inotify cannot watch it (its limits, a path that is
    no directory), after ``unwatched(error)`` has said what is then missed."""
    watcher = DirWatcher(path, callback, contents=contents)
    try:
        watcher.start()
    except OSError as exc:
        watcher.close()
        unwatched(exc)
        return None
    return watcher


class DirWatcher:
    """Watch ``path`` for entries created and removed (and written, with ``contents``); call ``callback``
    with each batch of events."""

    def __init__(self, path: str, callback: Callable[[list[DirEvent]], None], *, contents: bool = False) -> None:
        self.path = posixpath.normpath(path)
        self._callback = callback
        self._mask = _DIR_MASK | (IN_CLOSE_WRITE if contents else 0)
        self._fd = -1
        self._wd = -1
        self._ancestor_wd = -1
        self._loop: asyncio.AbstractEventLoop | None = None
        self.watching = False  # True while the directory itself is watched

    def start(self) -> None:
        """Open the inotify fd and install the watch; the caller reads state only after this."""
        lib = _lib()
        fd = lib.init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_init1: {os.strerror(err)}")
        self._fd = fd
        self._arm()
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(fd, self._on_readable)

    def close(self) -> None:
        if self._fd < 0:
            return
        if self._loop is not None:
            self._loop.remove_reader(self._fd)
        os.close(self._fd)
        self._fd = -1
        self.watching = False

    def _add(self, path: str, mask: int) -> int:
        wd: int = _lib().add_watch(self._fd, os.fsencode(path), mask)
        if wd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), path)
        return wd

    def _arm(self) -> bool:
        """Watch the directory if it exists, else its nearest existing ancestor; True if the former."""
        if self._ancestor_wd >= 0:
            _lib().rm_watch(self._fd, self._ancestor_wd)
            self._ancestor_wd = -1
        try:
            self._wd = self._add(self.path, self._mask)
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ENOTDIR):
                raise
        else:
            self.watching = True
            return True
        self.watching = False
        ancestor = posixpath.dirname(self.path)
        while True:
            try:
                self._ancestor_wd = self._add(ancestor, _ANCESTOR_MASK)
            except OSError as exc:
                if exc.errno not in (errno.ENOENT, errno.ENOTDIR) or ancestor == "/":
                    raise
                ancestor = posixpath.dirname(ancestor)
            else:
                break
        # The directory may have appeared between the two calls: check once more.
        if posixpath.isdir(self.path):
            return self._arm()
        return False

    def read_pending(self) -> None:
        """Handle events already queued now, without waiting for the loop to see the fd readable."""
        if self._fd >= 0:
            self._on_readable()

    def _on_readable(self) -> None:  # noqa: PLR0912 - one branch per inotify event kind
        events: list[DirEvent] = []
        rearm = False
        while True:
            try:
                buf = os.read(self._fd, 64 * 1024)
            except BlockingIOError:
                break
            offset = 0
            while offset < len(buf):
                wd, mask, _cookie, length = _EVENT.unpack_from(buf, offset)
                raw = buf[offset + _EVENT.size : offset + _EVENT.size + length]
                offset += _EVENT.size + length
                name = os.fsdecode(raw.rstrip(b"\0"))
                if mask & IN_Q_OVERFLOW:
                    events.append(DirEvent("overflow"))
                    rearm = True
                elif wd == self._wd:
                    if mask & (IN_DELETE_SELF | IN_MOVE_SELF | IN_IGNORED | IN_UNMOUNT):
                        if self.watching:
                            events.append(DirEvent("dir-gone", moved=bool(mask & IN_MOVE_SELF)))
                        self.watching = False
                        rearm = True
                    elif mask & (IN_CREATE | IN_MOVED_TO):
                        events.append(DirEvent("created", name))
                    elif mask & (IN_DELETE | IN_MOVED_FROM):
                        events.append(DirEvent("removed", name))
                    elif mask & IN_CLOSE_WRITE:
                        events.append(DirEvent("written", name))
                elif wd == self._ancestor_wd:
                    rearm = True
        if rearm and not self.watching:
            if self._wd >= 0:
                _lib().rm_watch(self._fd, self._wd)
                self._wd = -1
            if self._arm():
                events.append(DirEvent("dir-back"))
        if events:
            self._callback(events)
