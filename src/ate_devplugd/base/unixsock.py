"""Unix-socket files as the daemon sees them: which file is at a path, whether a process listens on it, and
the staging name a server binds before its socket is linked to the path.

A socket file's identity (device, inode, ctime) tells one file from a later one at the same path: inode
numbers are reused once a file is gone (ext4 and XFS hand out a freed one again at once), the ctime of a
new file is its creation. Both our own socket and kubelet's are told apart this way.
"""

from __future__ import annotations

import os
import posixpath
import socket
from typing import NamedTuple

#: Channel options for calls to a unix socket that the caller retries itself: gRPC does not retry them.
#: With gRPC's retries on (its default), grpcio 1.85 sometimes never finished a Register cut off by a
#: stopping kubelet's GOAWAY and allocated without bound until the call's deadline: over 4 GB in 15 s,
#: in 4 of 13 storms of 1,000 kubelet restarts; in none of 20 with them off.
ONE_ATTEMPT = (("grpc.enable_retries", 0),)


def staging_path(path: str) -> str:
    """Where the socket for ``path`` is bound before it is linked there (``base.unixserver``): its dot-name in
    the same directory, which kubelet ignores; one byte longer than ``path``, the longest path bound."""
    directory, base = posixpath.split(path)
    return posixpath.join(directory, "." + base)


def unix_target(path: str) -> str:
    """A gRPC target for the unix socket ``path``."""
    return "unix://" + os.path.abspath(path)


class FileIdentity(NamedTuple):
    """One file at a path, told apart from a later file at the same path."""

    dev: int
    ino: int
    ctime_ns: int

    @classmethod
    def of(cls, path: str) -> FileIdentity | None:
        """The file at ``path`` now (not following a symlink), or None when there is none."""
        try:
            st = os.lstat(path)
        except OSError:
            return None
        return cls(st.st_dev, st.st_ino, st.st_ctime_ns)


def socket_answers(path: str) -> bool:
    """Whether a process listens on the unix socket ``path`` (a non-blocking connect: it answers or
    refuses at once)."""
    peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
    try:
        peer.connect(path)
    except BlockingIOError:
        return True  # its backlog is full: it listens
    except OSError:
        return False
    finally:
        peer.close()
    return True
