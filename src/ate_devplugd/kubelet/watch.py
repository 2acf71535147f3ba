"""kubelet as the plugin directory shows it: which kubelet is there, and why our socket went.

One inotify watch on the directory (``DirWatcher``) wakes each session on every event about
``kubelet.sock``, about the directory itself or about the session's own socket. Events are hints only:
a woken session reads the state itself, so lost, late or reordered events cannot leave a wrong state.

Which kubelet: a kubelet is known by its ``kubelet.sock`` file (a ``FileIdentity``). A session keeps the
kubelet.sock its Register reached, read *after* the call returned. A Register succeeds only on a kubelet
that listens, and a new kubelet removes every plugin socket before it binds its own kubelet.sock; so the
file there after a successful Register is the kubelet that took it, or a newer one whose wipe has already
removed our socket (and the session starts afresh for that reason). What happened between the session's
look before the call and its connect (a new kubelet removing the stale socket and binding its own) no
longer matters, nor does the order in which the events arrive. A different kubelet.sock later is a kubelet
the session has not registered with.

A file's identity is its device, inode number and ctime, and a filesystem hands a freed inode number to
the next file at once (ext4 does); two kubelet.sock files created within one tick of the coarse clock
would then look alike. So the watch holds each kubelet.sock it hands out open (``O_PATH``: no I/O, no
lock, nothing kubelet can see but a removed file's inode kept a little longer), the last ``HELD`` of
them: while held, an inode cannot pass to a later file, and a look can never mistake a new kubelet for
the one a session registered with.

Why our socket went: kubelet's start-up wipe (``CleanupPluginDirectory``) lists the directory with
``Readdirnames``, which does not sort, and removes every socket in the filesystem's directory order (tmpfs:
newest first; ext4: hash order); only then does it bind its new kubelet.sock. A killed kubelet leaves its
old one behind. So when our socket goes, the old kubelet.sock may still be there or already gone, with
other plugins' sockets removed before or after ours. The socket went with a kubelet restart when the
kubelet.sock there is not the known one (gone, or another) or no longer answers; only while the known
kubelet still answers was it someone else.

What kubelet offers: its device manager changes what it offers of a resource when a client for the name
registers or its stream ends, neither of which need touch our socket or our stream (kubelet 1.36 swaps
the client of a name without ending the older one's stream). What the directory shows of that is another
plugin's socket appearing or leaving, and kubelet's checkpoint rewritten (it took in some plugin's device
list). Those events, kubelet.sock's creation and lost events go to the ``on_changes`` listeners
(``kubelet.word`` asks kubelet then); our own sockets' events, dot-named staging and temp files do not.
"""

from __future__ import annotations

import enum
import logging
import os
import posixpath
from collections import OrderedDict
from collections.abc import Callable

from ate_devplugd.base.inotify import DirEvent, DirWatcher
from ate_devplugd.base.logs import EventLog
from ate_devplugd.base.look import Look, look
from ate_devplugd.base.unixsock import FileIdentity, socket_answers
from ate_devplugd.kubelet.dp_state import CHECKPOINT

log = logging.getLogger(__name__)

#: The events the plugin directory's own removal and return are logged as (the watch's event kinds).
EVENTS = ("dir-gone", "dir-back")

KUBELET_SOCKET = "kubelet.sock"
#: kubelet.sock files held open at once (see the module doc); a session only ever compares against one
#: of the last few it looked at.
HELD = 4


class SocketLoss(enum.Enum):
    """Why a session's socket went."""

    KUBELET_RESTART = "kubelet-restart"
    FOREIGN = "socket-removed"


class KubeletWatch:
    """Watches the plugin directory for kubelet and for the sessions' sockets."""

    def __init__(self, plugin_dir: str, on_kubelet: Callable[[], None] | None = None) -> None:
        self.plugin_dir = plugin_dir
        #: Called for each kubelet.sock created (a kubelet starting).
        self._on_kubelet = on_kubelet
        self.kubelet_socket = posixpath.join(plugin_dir, KUBELET_SOCKET)
        self._subscribers: dict[str, list[Callable[[], None]]] = {}
        #: Called with each batch's events that may change what kubelet offers (the module doc).
        self._on_changes: list[Callable[[list[DirEvent]], None]] = []
        self._dir = DirWatcher(plugin_dir, self._on_events)
        #: The kubelet.sock files handed out last, each with the O_PATH descriptor that holds its inode.
        self._held: OrderedDict[FileIdentity, int] = OrderedDict()
        self._events = EventLog(log)

    def start(self) -> None:
        """Install the watch; read any state only after this."""
        self._dir.start()

    def close(self) -> None:
        self._dir.close()
        for fd in self._held.values():
            os.close(fd)
        self._held.clear()

    def subscribe(self, socket_name: str, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` on events about kubelet, the directory or ``socket_name``; returns the undo."""
        self._subscribers.setdefault(socket_name, []).append(callback)

        def unsubscribe() -> None:
            callbacks = self._subscribers.get(socket_name, [])
            if callback in callbacks:
                callbacks.remove(callback)
            if not callbacks:
                self._subscribers.pop(socket_name, None)

        return unsubscribe

    def on_changes(self, callback: Callable[[list[DirEvent]], None]) -> Callable[[], None]:
        """Call ``callback`` with the events that may change what kubelet offers (the module doc); returns
        the undo."""
        self._on_changes.append(callback)
        return lambda: self._on_changes.remove(callback) if callback in self._on_changes else None

    def dir_exists(self) -> bool:
        return look(self.plugin_dir, directory=True) is not Look.ABSENT

    def kubelet(self) -> FileIdentity | None:
        """The kubelet.sock there now (None when there is none): which kubelet a Register would reach. Its
        inode is held until ``HELD`` other files have been seen (see the module doc)."""
        try:
            fd = os.open(self.kubelet_socket, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        st = os.fstat(fd)
        identity = FileIdentity(st.st_dev, st.st_ino, st.st_ctime_ns)
        if identity in self._held:
            os.close(fd)
            self._held.move_to_end(identity)
        else:
            self._held[identity] = fd
            while len(self._held) > HELD:
                os.close(self._held.popitem(last=False)[1])
        return identity

    def answers(self) -> bool:
        """Whether a kubelet listens on kubelet.sock now."""
        return socket_answers(self.kubelet_socket)

    def socket_loss(self, known: FileIdentity | None) -> SocketLoss:
        """Why a socket served while ``known`` was the kubelet is gone."""
        # Ask first, then look: looked at first, a stale known kubelet.sock replaced by a new kubelet's
        # live one between the two would pass for the known kubelet still answering.
        answers = self.answers()
        if self.kubelet() != known or not answers:
            return SocketLoss.KUBELET_RESTART
        return SocketLoss.FOREIGN

    def _on_events(self, events: list[DirEvent]) -> None:
        everyone = False
        names: set[str] = set()
        offer = [ev for ev in events if self._may_change_offer(ev)]
        for ev in events:
            if ev.kind in ("overflow", "dir-gone", "dir-back") or ev.name == KUBELET_SOCKET:
                # kubelet came or went, or events were lost: every session looks again
                everyone = True
                if ev.kind == "created" and ev.name == KUBELET_SOCKET and self._on_kubelet is not None:
                    self._on_kubelet()
            elif ev.kind in ("removed", "created"):
                # "created" too: a file renamed over a socket replaces it without a "removed" event
                names.add(ev.name)
            if ev.kind in ("dir-gone", "dir-back"):
                self._events.warning(
                    ev.kind, "%s %s", self.plugin_dir, "was removed" if ev.kind == "dir-gone" else "is back"
                )
        for name, callbacks in list(self._subscribers.items()):
            if everyone or name in names:
                for callback in list(callbacks):
                    callback()
        if offer:
            for changed in list(self._on_changes):
                changed(offer)

    def _may_change_offer(self, ev: DirEvent) -> bool:
        """Another plugin's socket came or went, kubelet wrote its checkpoint or started, or events were lost."""
        if ev.kind in ("overflow", "dir-back"):
            return True
        if ev.kind not in ("created", "removed") or ev.name.startswith(".") or ev.name in self._subscribers:
            return False
        if ev.name in (KUBELET_SOCKET, CHECKPOINT):
            return ev.kind == "created"
        return True
