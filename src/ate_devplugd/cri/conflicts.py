"""Other CDI specs that define our names, and specs of ours the CDI library would refuse: read and followed.

``scan`` reads the spec files of the directories the runtime reads as the CDI library does (its order,
its file names; ``cri.rules`` holds the rules, with no I/O), ``find`` says what stops our names from
resolving to our specs, and ``SpecCheck`` is the daemon's use of it: a scan at start, on reload and
whenever the runtime is asked again, and on every spec file created, removed, renamed or written in
one of those directories (inotify on each, on the loop; one scan ``SETTLE_DELAY`` after the first event
of a burst). Each new problem is logged once, a warning naming the file (``cdi-conflict``, or
``cdi-invalid`` for a spec of ours that does not load), and shown in STATUS until it is gone.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import posixpath
import stat
from collections.abc import Callable, Iterable, Sequence

from ate_devplugd.base.inotify import DirEvent, DirWatcher, watch_dir
from ate_devplugd.base.logs import EventLog
from ate_devplugd.config.device import DeviceConfig, qualified_name
from ate_devplugd.cri.facts import reads_dir
from ate_devplugd.cri.rules import LoadedSpec, SpecProblem, Trouble, is_spec_file, load, problems
from ate_devplugd.node.cdispec import spec_path

log = logging.getLogger(__name__)

#: Journal events: another spec defines one of our names; a spec of ours does not load.
EVENT_CONFLICT = "cdi-conflict"
EVENT_INVALID = "cdi-invalid"
#: Journal event: a spec directory cannot be watched (the same event as for the runtime socket's).
EVENT_UNWATCHED = "cdi-unwatched"
#: How long after the first event in a spec directory it is read again (a tool writing several files
#: is one scan).
SETTLE_DELAY = 0.05


def _unwatched(directory: str, exc: OSError) -> None:
    EventLog(log).warning(
        EVENT_UNWATCHED,
        "cdi: cannot watch %s for spec files (%s); it is read again only when the runtime is asked",
        directory,
        exc.strerror or exc,
    )


def dirs_to_read(runtime_dirs: Sequence[str] | None, cdi_dir: str) -> tuple[str, ...]:
    """The directories the spec check reads: the runtime's (where it said them), with ``cdi_dir`` first
    where none of them is it (so our own spec there is still read); ``cdi_dir`` alone where the runtime
    did not say (no runtime answering, or one that does not report them)."""
    if runtime_dirs is None:
        return (cdi_dir,)
    if any(reads_dir(d, cdi_dir) for d in runtime_dirs):
        return tuple(runtime_dirs)
    return (cdi_dir, *runtime_dirs)


def scan(dirs: Sequence[str]) -> list[LoadedSpec]:
    """The spec files of ``dirs`` in the order the library reads them, each loaded: a directory's files
    by name, ``*.json`` and ``*.yaml`` only, no subdirectory, and no directory that is itself a symlink
    (it walks each from an ``Lstat``); a file's priority is its directory's index."""
    out: list[LoadedSpec] = []
    for priority, directory in enumerate(posixpath.normpath(d) for d in dirs):
        try:
            if os.path.islink(directory):
                continue
            names = sorted(os.listdir(directory))
        except OSError:
            continue
        for name in names:
            path = posixpath.join(directory, name)
            if not is_spec_file(name):
                continue
            try:
                if stat.S_ISDIR(os.lstat(path).st_mode):
                    continue
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError) as exc:
                out.append(LoadedSpec(path, priority, error=f"cannot read it: {exc}"))
                continue
            out.append(load(path, priority, text))
    return out


def ours(dirs: Sequence[str], cdi_dir: str, devices: Iterable[DeviceConfig]) -> dict[str, tuple[str, ...]]:
    """Our qualified names, each with the paths the runtime reads our spec under (one per directory of
    ``dirs`` that is our ``cdi_dir``; ours where none is)."""
    out: dict[str, tuple[str, ...]] = {}
    for dev in devices:
        if not dev.cdi:
            continue
        path = spec_path(cdi_dir, dev)
        seen = [posixpath.join(posixpath.normpath(d), posixpath.basename(path)) for d in dirs if reads_dir(d, cdi_dir)]
        out[qualified_name(dev)] = tuple(seen) or (path,)
    return out


def find(dirs: Sequence[str], cdi_dir: str, devices: Iterable[DeviceConfig]) -> list[SpecProblem]:
    """What stops our names from resolving to our specs in the directories the runtime reads."""
    return problems(scan(dirs), ours(dirs, cdi_dir, devices))


class SpecCheck:
    """The daemon's watch on the runtime's spec directories: see the module's docstring."""

    def __init__(self, on_change: Callable[[], None]) -> None:
        self._on_change = on_change
        self._dirs: tuple[str, ...] = ()
        self._cdi_dir = ""
        self._devices: tuple[DeviceConfig, ...] = ()
        self._watchers: list[DirWatcher] = []
        self._settle: asyncio.TimerHandle | None = None
        self._problems: tuple[SpecProblem, ...] = ()
        #: Our spec files as the last scan found them (inode, mtime): read again when they differ.
        self._ours_seen: tuple[tuple[int, int] | None, ...] = ()

    @property
    def problems(self) -> tuple[SpecProblem, ...]:
        """The problems, as of our own specs now: where one of ours was written, rewritten or removed since
        the last scan (the daemon writes ours after its first scan, at start), the directories are read
        again first, so that no decision rests on a reading older than our own write. The owner hears a
        change found so on the next turn of the loop."""
        if self._dirs and self._ours_now() != self._ours_seen:
            before = self._problems
            self._rescan(notify=False)
            if self._problems != before:
                asyncio.get_running_loop().call_soon(self._on_change)
        return self._problems

    @property
    def watched(self) -> tuple[str, ...]:
        return self._dirs

    def start(self, dirs: Sequence[str], cdi_dir: str, devices: Sequence[DeviceConfig]) -> None:
        """Watch ``dirs`` (kept when they are the ones watched) and read them now."""
        dirs = tuple(posixpath.normpath(d) for d in dirs)
        if dirs != self._dirs:
            self._unwatch()
            for directory in dict.fromkeys(dirs):
                watcher = watch_dir(directory, self._on_events, functools.partial(_unwatched, directory), contents=True)
                if watcher is not None:
                    self._watchers.append(watcher)
            self._dirs = dirs
        self._cdi_dir, self._devices = cdi_dir, tuple(devices)
        self._rescan()

    def close(self) -> None:
        """Stop watching and forget every problem (a later one is logged anew)."""
        self._unwatch()
        self._dirs = ()
        self._set(())

    def _unwatch(self) -> None:
        if self._settle is not None:
            self._settle.cancel()
            self._settle = None
        for watcher in self._watchers:
            watcher.close()
        self._watchers = []

    def _on_events(self, events: list[DirEvent]) -> None:
        if not any(is_spec_file(ev.name) or not ev.name for ev in events):
            return
        if self._settle is None:
            self._settle = asyncio.get_running_loop().call_later(SETTLE_DELAY, self._settled)

    def _settled(self) -> None:
        self._settle = None
        self._rescan()

    def _ours_now(self) -> tuple[tuple[int, int] | None, ...]:
        out: list[tuple[int, int] | None] = []
        for paths in ours(self._dirs, self._cdi_dir, self._devices).values():
            for path in paths:
                try:
                    st = os.lstat(path)
                except OSError:
                    out.append(None)
                else:
                    out.append((st.st_ino, st.st_mtime_ns))
        return tuple(out)

    def _rescan(self, *, notify: bool = True) -> None:
        self._ours_seen = self._ours_now()
        self._set(tuple(find(self._dirs, self._cdi_dir, self._devices)), notify=notify)

    def _set(self, found: tuple[SpecProblem, ...], *, notify: bool = True) -> None:
        events = EventLog(log)
        for problem in found:
            if problem in self._problems:
                continue
            if problem.trouble is Trouble.REFUSED:
                events.warning(EVENT_INVALID, "cdi: %s", problem.describe())
            else:
                events.warning(EVENT_CONFLICT, "cdi: %s", problem.describe())
        if found != self._problems:
            self._problems = found
            if notify:
                self._on_change()


def status(found: Iterable[SpecProblem]) -> str:
    """STATUS's part for the problems ("" when none):
    ``cdi spec conflict: /etc/cdi/x.json also defines ate.dev/kvm=kvm``."""
    parts = []
    for problem in found:
        if problem.trouble is Trouble.REFUSED:
            parts.append(f"cdi spec refused: {problem.path}")
        else:
            parts.append(f"cdi spec {problem.trouble.value}: {problem.path} also defines {problem.name}")
    return "; ".join(parts)
