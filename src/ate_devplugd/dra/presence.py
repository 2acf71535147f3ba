"""Whether the kubelet that registered the DRA driver is still there: events only, no polling.

kubelet registers a DRA driver once, when its plugin watcher finds the registration socket (at its start,
or when the socket is created); it says nothing when it stops. A stopped kubelet leaves
``plugins_registry`` and its ``device-plugins/kubelet.sock`` as they were (a killed process unlinks
nothing), so no file event tells. What does tell, each on the loop:

- the kubelet process ending: its pid comes from kubelet.sock (``SO_PEERCRED`` of a connection, which
  gives the pid that listens) and a pidfd of it becomes readable when the process exits, whatever
  version kubelet is and whatever else it holds open;
- kubelet's health stream (``NodeWatchResources``, held by kubelet 1.36) ending; the driver calls
  ``changed`` for that;
- ``kubelet.sock`` removed or created (``KubeletWatch``): a starting kubelet removes the old one and
  creates its own.

Each is only a hint: ``holds()`` then looks (does kubelet.sock answer? is it still the file that was
there when kubelet registered the driver, as ``KubeletWatch`` knows a kubelet?), so a lost or reordered
event cannot leave a wrong answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import socket
import struct
from collections.abc import Callable

from ate_devplugd.base.unixsock import FileIdentity
from ate_devplugd.kubelet.watch import KUBELET_SOCKET, KubeletWatch

log = logging.getLogger(__name__)

_UCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid


class Presence(enum.Enum):
    """The kubelet that registered the driver, as seen now."""

    #: It still runs (its kubelet.sock, the same file, answers).
    HOLDS = "holds"
    #: Another kubelet.sock answers: a kubelet that has not registered the driver (yet).
    RESTARTED = "restarted"
    #: Its kubelet.sock does not answer: no kubelet runs.
    GONE = "gone"


def listener_pid(path: str) -> int | None:
    """The pid of the process listening on the unix socket ``path`` (None if none answers or the kernel
    cannot say, as for a listener in another pid namespace)."""
    peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
    try:
        peer.connect(path)
        pid, _uid, _gid = _UCRED.unpack(peer.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    except OSError:
        return None
    finally:
        peer.close()
    return pid or None


class KubeletPresence:
    """Follows the kubelet that registered the driver; ``on_change`` hears every hint that it may be gone."""

    def __init__(self, watch: KubeletWatch, on_change: Callable[[], None]) -> None:
        self._watch = watch
        self._on_change = on_change
        #: The kubelet.sock there when kubelet registered the driver: that kubelet.
        self._kubelet: FileIdentity | None = None
        self._pidfd = -1
        #: The pid listening on kubelet.sock when kubelet registered the driver (None: not known).
        self._pid: int | None = None
        self._unsubscribe: Callable[[], None] | None = None

    @property
    def kubelet_pid(self) -> int | None:
        """The pid of the kubelet followed (None when no process is followed)."""
        return self._pid if self._pidfd >= 0 else None

    def start(self) -> None:
        """Hear kubelet.sock's events (the watch is the daemon's, already started)."""
        if self._unsubscribe is None:
            self._unsubscribe = self._watch.subscribe(KUBELET_SOCKET, self._on_change)

    def close(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        self._unfollow()

    def registered(self) -> None:
        """kubelet has just registered the driver: remember which kubelet (kubelet registers drivers
        only after its device manager has bound its kubelet.sock), and follow its process."""
        self._kubelet = self._watch.kubelet()
        self._pid = self._kubelet_pid()
        self._follow()

    def holds(self) -> Presence:
        """Whether the kubelet that registered the driver still runs. Ask first, then look, as
        ``KubeletWatch.socket_loss`` does: looked at first, a stale kubelet.sock replaced by a new
        kubelet's live one between the two would pass for the old kubelet still answering."""
        answers = self._watch.answers()
        if not answers:
            return Presence.GONE
        return Presence.HOLDS if self._watch.kubelet() == self._kubelet else Presence.RESTARTED

    def _kubelet_pid(self) -> int | None:
        pid = listener_pid(self._watch.kubelet_socket)
        return None if pid == os.getpid() else pid  # a kubelet stand-in in this very process tells nothing

    def _follow(self) -> None:
        self._unfollow()
        pid = self._pid
        if pid is None:
            return
        # No pidfd (Linux before 5.3, a seccomp filter that refuses it): the other hints remain.
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError) as exc:
            log.debug("dra: cannot follow kubelet's process %d: %s", pid, exc)
            return
        self._pidfd = fd
        loop = asyncio.get_running_loop()
        loop.add_reader(fd, self._exited)
        if self._kubelet_pid() != pid:  # it ended (or was replaced) in between: a hint once the caller is done
            loop.call_soon(self._exited)

    def _exited(self) -> None:
        if self._pidfd < 0:  # already heard (the reader and the check above may both call)
            return
        self._unfollow()
        self._on_change()

    def _unfollow(self) -> None:
        if self._pidfd >= 0:
            with contextlib.suppress(RuntimeError):  # the loop is closed at exit
                asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = -1
