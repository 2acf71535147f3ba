"""The plugin directory, ours to serve: made if missing, one daemon per directory, no live process's socket taken.

The directory is the one the mode serves in (``InstanceLock.of``): kubelet's device-plugin directory, or
in DRA mode the driver's own plugin directory, which DRA mode's server makes (``dra.service``); a DRA
daemon neither makes nor locks kubelet's device-plugin directory.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import posixpath
import socket
from collections.abc import Callable

from ate_devplugd.base import announce
from ate_devplugd.base.logs import EventLog
from ate_devplugd.base.look import Look, look
from ate_devplugd.base.unixserver import SocketInUseError, check_socket_free
from ate_devplugd.config import Config
from ate_devplugd.config.device import DeviceConfig

log = logging.getLogger(__name__)


class NoPermissionError(Exception):
    """The daemon's user may never create or write a directory it needs: permission bits refuse it
    (EACCES), which, unlike a read-only or full file system, does not pass by itself."""


def no_permission(verb: str, directory: str) -> NoPermissionError:
    return NoPermissionError(
        f"cannot {verb} {directory}: permission denied (uid {os.geteuid()}); ate-devplugd runs as root, "
        "and the directory must be root's"
    )


def make_plugin_dir(plugin_dir: str) -> None:
    """Create the directory 0750 (as kubelet does) if it is missing; if that fails, the sessions wait for it.

    Raises NoPermissionError when our user may not create the directory or write in it; a read-only or
    immutable file system, or one still to be mounted, is waited for instead."""
    seen = look(plugin_dir, directory=True)
    if seen is Look.CANNOT_LOOK:  # not "cannot create": it may well be there
        raise no_permission("look at", plugin_dir)
    if seen is Look.ABSENT:
        try:
            os.makedirs(plugin_dir, mode=0o750, exist_ok=True)
            log.info("created %s", plugin_dir)
        except OSError as exc:
            if exc.errno == errno.EACCES:
                raise no_permission("create", plugin_dir) from exc
            EventLog(log).warning(
                "dir-wait", "cannot create %s (%s); waiting for it to appear", plugin_dir, exc.strerror
            )
        return
    if _access_errno(plugin_dir, os.W_OK | os.X_OK) == errno.EACCES:
        raise no_permission("write", plugin_dir)


def _access_errno(path: str, mode: int) -> int:
    """0 if access(2) grants ``mode`` on ``path``, else its errno (EACCES: the permission bits; EROFS or
    EPERM: a read-only or immutable file system). os.access says only yes or no."""
    libc = ctypes.CDLL(None, use_errno=True)
    access = libc.access
    access.argtypes = [ctypes.c_char_p, ctypes.c_int]
    access.restype = ctypes.c_int
    return 0 if access(os.fsencode(path), mode) == 0 else ctypes.get_errno()


#: An abstract socket name has at most 107 bytes after its leading NUL.
_MAX_ABSTRACT_NAME = 107
_LOCK_PREFIX = b"\0ate-devplugd/"


def lock_name(plugin_dir: str) -> bytes:
    """``@ate-devplugd/<real path of plugin_dir>`` (``ss -xl`` shows which directory is held), or, for a
    path too long for that, ``@ate-devplugd/sha256:<its digest>``."""
    path = os.path.realpath(plugin_dir).encode()
    if len(_LOCK_PREFIX) - 1 + len(path) <= _MAX_ABSTRACT_NAME:
        return _LOCK_PREFIX + path
    import hashlib  # noqa: PLC0415 - 0.7 MiB of RSS (OpenSSL's digests), only for such a path

    return _LOCK_PREFIX + b"sha256:" + hashlib.sha256(path).hexdigest().encode()


class InstanceLock:
    """An abstract unix socket named after the plugin directory: one daemon per directory.

    Held, it is where the daemon announces its record of itself (``base.announce``): each peer is told it,
    and the daemon's own user may stay to hear each new one. A second daemon's probe is told it too and
    closed, so refused starts never fill its queue and make it look like someone else's.
    """

    def __init__(self, plugin_dir: str) -> None:
        #: The directory it is named after.
        self.directory = plugin_dir
        self.name = lock_name(plugin_dir)
        self._sock: socket.socket | None = None
        self._announcer: announce.Announcer | None = None

    @classmethod
    def of(cls, config: Config) -> InstanceLock:
        """The lock of the daemon running ``config``, named after the directory it serves in: the
        device-plugin directory, or in DRA mode the directory of the driver's dra.sock
        (``<kubelet_dir>/plugins/<driver>``)."""
        if config.mode == "dra" and config.dra is not None:
            return cls(posixpath.dirname(config.dra.plugin_socket))
        return cls(config.plugin_dir)

    @classmethod
    def candidates(cls, config: Config) -> tuple[InstanceLock, ...]:
        """The locks a daemon started from ``config`` may hold: its mode's first, then the other mode's
        (a file whose ``mode`` changed since the daemon started names the directory it serves still)."""
        first = cls.of(config)
        others = [cls(config.plugin_dir)]
        if config.dra is not None:
            others.append(cls(posixpath.dirname(config.dra.plugin_socket)))
        return (first, *(lock for lock in others if lock.name != first.name))

    def acquire(self, render: Callable[[], bytes] = lambda: b"{}") -> bool:
        """Take the name (False: a daemon of ours holds it), announcing there the record ``render`` makes.
        Called on the running loop."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        try:
            sock.bind(self.name)
            sock.listen(8)
        except OSError as exc:
            sock.close()
            if exc.errno != errno.EADDRINUSE:
                raise
            holder = self.holder()
            uid = None if holder is None else holder[1]
            if uid == os.geteuid():
                return False
            # Abstract names have no permissions: any local user may bind this one first. A holder of
            # another user is not an ate-devplugd of ours; going on without the lock is safe, because
            # a live socket at our path still stops us.
            EventLog(log).warning(
                "lock-foreign", "the instance lock name is held by uid %s, not by us; going on without it", uid
            )
            return True
        self._sock = sock
        self._announcer = announce.Announcer(sock, render)
        return True

    def changed(self) -> None:
        """The record changed: the peers that watch it hear the new one."""
        if self._announcer is not None:
            self._announcer.changed()

    def holder(self) -> tuple[int, int] | None:
        """(pid, uid) of the process holding the lock name (an ate-devplugd listens on it), if it answers."""
        found = announce.holder(self.name)
        return None if found is None else (found.pid, found.uid)

    def let_go(self) -> None:
        """Free the name for the next daemon (a handover's successor), while those watching our record
        go on hearing it until ``release``."""
        if self._announcer is not None:
            self._announcer.stop_listening()
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def release(self) -> None:
        self.let_go()
        if self._announcer is not None:
            self._announcer.close()
            self._announcer = None


def held_names(net_unix: str = "/proc/self/net/unix") -> list[bytes]:
    """Every instance lock name held on this host (listening sockets named ``@ate-devplugd/...``), in the
    kernel's order: the daemons a command may find when none serves the config it was given."""
    try:
        with open(net_unix, "rb") as fh:
            lines = fh.read().splitlines()[1:]
    except OSError:
        return []
    found = []
    for line in lines:
        fields = line.split(None, 7)
        # Num RefCount Protocol Flags Type St Inode Path; a listener has __SO_ACCEPTCON (0x10000) in Flags
        if len(fields) == 8 and int(fields[3], 16) & 0x10000 and fields[7].startswith(b"@" + _LOCK_PREFIX[1:]):
            found.append(b"\0" + fields[7][1:])
    return found


def busy_sockets(plugin_dir: str, devices: tuple[DeviceConfig, ...]) -> list[str]:
    """Why each device's socket path cannot be ours (a live process answers there); stale ones are removed."""
    busy = []
    for dev in devices:
        try:
            check_socket_free(posixpath.join(plugin_dir, dev.socket_name))
        except SocketInUseError as exc:
            busy.append(str(exc))
        except OSError:
            continue
    return busy
