"""kubelet as the plugin directory shows it: is it there, has it restarted, and why did our socket go.

One inotify watch on the directory (``DirWatcher``) keeps the *kubelet generation*: a number that goes
up each time a ``kubelet.sock`` is created (and when events were lost or the directory came back, since
a new kubelet may then have come unseen). A session remembers the generation it registered under; a
different one later means a kubelet it has not registered with.

The stat-then-drain rule: ``look()`` stats ``kubelet.sock`` first and only then handles the inotify
events already queued. A kubelet.sock seen by the stat has had its create event counted, so that event
cannot later look like a newer kubelet (which would mean a second Register to the same kubelet).

Why our socket went: kubelet starts by removing every socket in the directory in name order, and only
then creates its new ``kubelet.sock``; a killed kubelet leaves its old one behind. So at the moment our
socket goes (``ate.dev-…`` sorts before ``kubelet.sock``), the directory still shows the old
``kubelet.sock`` and no create event has come. The socket went with a kubelet restart when a new
kubelet.sock has come since, or when the kubelet.sock there no longer answers (its kubelet is gone);
only while the kubelet we know still answers was it someone else.
"""

from __future__ import annotations

import enum
import logging
import os
import posixpath
import socket
from collections.abc import Callable
from dataclasses import dataclass

from ate_devplugd.inotify import DirEvent, DirWatcher
from ate_devplugd.logs import EventLog

log = logging.getLogger("ate_devplugd")

KUBELET_SOCKET = "kubelet.sock"


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


class SocketLoss(enum.Enum):
    """Why a session's socket went."""

    KUBELET_RESTART = "kubelet-restart"
    FOREIGN = "socket-removed"


@dataclass(frozen=True)
class KubeletState:
    """What ``look()`` saw: whether a kubelet.sock exists, and the kubelet generation then."""

    present: bool
    generation: int


class KubeletWatch:
    """Watches the plugin directory for kubelet and for the sessions' sockets."""

    def __init__(self, plugin_dir: str, on_kubelet: Callable[[], None] | None = None) -> None:
        self.plugin_dir = plugin_dir
        #: Called for each kubelet.sock created (a kubelet starting).
        self._on_kubelet = on_kubelet
        self.kubelet_socket = posixpath.join(plugin_dir, KUBELET_SOCKET)
        self._generation = 0
        self._subscribers: dict[str, list[Callable[[], None]]] = {}
        self._dir = DirWatcher(plugin_dir, self._on_events)
        self._events = EventLog(log)

    @property
    def generation(self) -> int:
        return self._generation

    def start(self) -> None:
        """Install the watch; read any state only after this."""
        self._dir.start()

    def close(self) -> None:
        self._dir.close()

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

    def dir_exists(self) -> bool:
        return os.path.isdir(self.plugin_dir)

    def look(self) -> KubeletState:
        """Whether kubelet.sock exists, and the generation counting its creation (stat, then drain)."""
        present = os.path.exists(self.kubelet_socket)
        self._dir.read_pending()
        return KubeletState(present, self._generation)

    def socket_loss(self, known_generation: int) -> SocketLoss:
        """Why a socket served under generation ``known_generation`` is gone."""
        # Ask first, then count: a new kubelet.sock that answers had its create event queued before
        # the connect, so the drain after it sees the new generation.
        answers = socket_answers(self.kubelet_socket)
        if self.look().generation != known_generation or not answers:
            return SocketLoss.KUBELET_RESTART
        return SocketLoss.FOREIGN

    def _on_events(self, events: list[DirEvent]) -> None:
        everyone = False
        names: set[str] = set()
        for ev in events:
            if ev.kind in ("overflow", "dir-back") or (ev.kind == "created" and ev.name == KUBELET_SOCKET):
                # a kubelet.sock we have not registered with (or may not have: events were lost)
                self._generation += 1
                everyone = True
                if ev.kind == "created" and self._on_kubelet is not None:
                    self._on_kubelet()
            elif ev.kind == "dir-gone" or ev.name == KUBELET_SOCKET:
                everyone = True
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
