"""The files the API server credentials come from, followed: a new token is used at once, with no restart.

A kubeconfig names other files: a token file (a service account's token that a timer renews), a client
certificate and key (kubelet rotates its own), a CA. Each directory that holds one of them, and the
kubeconfig's own, is watched with inotify (``inotify.DirWatcher``, on the loop: no thread, no polling).
On any event there the files are read again and compared with the bytes the credentials in use were
read from (``kubeconfig.Credentials.sources``); when one differs, ``generation`` goes up and waiters wake.
The slice publisher then starts a session with the new credentials at once (cutting its back-off short),
and prepare builds its client again. A file written in place, a file renamed into place and a swapped
symlink each show as an event in its directory; events are hints, the bytes decide.
"""

from __future__ import annotations

import asyncio
import logging
import posixpath
from collections.abc import Callable, Iterable

from ate_devplugd.base.inotify import DirEvent, DirWatcher
from ate_devplugd.base.logs import EventLog
from ate_devplugd.dra import kubeconfig
from ate_devplugd.dra.kubeconfig import Credentials, KubeconfigError, Source

log = logging.getLogger(__name__)


class CredentialFiles:
    """Loads the credentials of kubeconfig ``path`` and watches the files they were read from."""

    def __init__(self, path: str, load: Callable[[str], Credentials] = kubeconfig.load) -> None:
        self.path = path
        self._load = load
        #: Goes up each time a file the credentials were read from has changed since.
        self.generation = 0
        self._sources: tuple[Source, ...] = ()
        #: A change was seen and not loaded yet: later events add nothing.
        self._stale = False
        self._changed = asyncio.Event()
        self._watchers: dict[str, DirWatcher] = {}
        self._watching = False
        self._unwatched_said = False

    def start(self) -> None:
        """Watch the kubeconfig's directory (and, after each load, those of the files it names)."""
        self._watching = True
        self._watch((self.path,))

    def close(self) -> None:
        self._watching = False
        for watcher in self._watchers.values():
            watcher.close()
        self._watchers.clear()

    def load(self) -> Credentials:
        """The credentials as the files say now; from now on a change to any of those files is seen.

        A load that reads other bytes than the last one (a change whose event is not handled yet) raises
        the generation too, so whoever loaded before learns of it; a caller notes the generation after
        its load."""
        announced, self._stale = self._stale, False
        try:
            credentials = self._load(self.path)
        except KubeconfigError as exc:
            self._follow(exc.sources, announced)
            raise
        self._follow(credentials.sources, announced)
        return credentials

    async def changed(self, after: int) -> None:
        """Returns once ``generation`` is above ``after``."""
        while self.generation <= after:
            event = self._changed
            await event.wait()

    def _follow(self, sources: tuple[Source, ...], announced: bool) -> None:
        """Compare with what was read before (unless a change was already announced) and watch the files."""
        before = dict(self._sources)
        changed = [path for path, seen in sources if path in before and before[path] != seen]
        if changed and not announced:
            self._changed_now(changed)
        self._sources = sources
        if self._watch(path for path, _ in sources):
            # A directory watched only now: a change between the read and the watch is looked for here.
            self._check()

    def _watch(self, paths: Iterable[str]) -> bool:
        """Watch the directories of ``paths`` not watched yet; whether any was added."""
        if not self._watching:
            return False
        added = False
        for directory in {posixpath.dirname(posixpath.abspath(p)) for p in paths}:
            if directory in self._watchers:
                continue
            watcher = DirWatcher(directory, self._on_events, contents=True)
            try:
                watcher.start()
            except OSError as exc:  # inotify's limits: the files are still read again at every session
                watcher.close()
                if not self._unwatched_said:
                    EventLog(log).warning(
                        "dra-credentials-unwatched",
                        "dra: cannot watch %s (%s): a new token there is used at the next retry or watch renewal",
                        directory,
                        exc,
                    )
                    self._unwatched_said = True
                continue
            self._watchers[directory] = watcher
            added = True
        return added

    def _on_events(self, events: list[DirEvent]) -> None:
        self._check()

    def _check(self) -> None:
        if self._stale:
            return
        changed = [path for path, seen in self._sources if kubeconfig.file_digest(path) != seen]
        if not changed:
            return
        self._stale = True
        self._changed_now(changed)

    def _changed_now(self, changed: list[str]) -> None:
        self.generation += 1
        EventLog(log).info(
            "dra-credentials-changed",
            "dra: %s changed: the API server is asked again with the credentials as they are now",
            ", ".join(changed),
        )
        event, self._changed = self._changed, asyncio.Event()
        event.set()
