"""The plugin-directory watch, against real inotify."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
from pathlib import Path

from ate_devplugd.base.inotify import DirEvent, DirWatcher


class Collector:
    def __init__(self) -> None:
        self.queue: asyncio.Queue[DirEvent] = asyncio.Queue()

    def __call__(self, events: list[DirEvent]) -> None:
        for ev in events:
            self.queue.put_nowait(ev)

    async def until(self, wanted: DirEvent, timeout: float = 5.0) -> list[DirEvent]:
        seen = []
        async with asyncio.timeout(timeout):
            while True:
                ev = await self.queue.get()
                seen.append(ev)
                if ev == wanted:
                    return seen


class TestDirWatcher:
    async def test_created_and_removed(self, tmp_path: Path) -> None:
        """Sockets created and removed in the directory are reported by name."""
        got = Collector()
        watch = DirWatcher(str(tmp_path), got)
        watch.start()
        try:
            sock = socket.socket(socket.AF_UNIX)
            sock.bind(str(tmp_path / "kubelet.sock"))
            await got.until(DirEvent("created", "kubelet.sock"))
            os.unlink(tmp_path / "kubelet.sock")
            sock.close()
            await got.until(DirEvent("removed", "kubelet.sock"))
            (tmp_path / "a").write_text("")
            os.rename(tmp_path / "a", tmp_path / "b")
            seen = await got.until(DirEvent("created", "b"))
            assert DirEvent("removed", "a") in seen
        finally:
            watch.close()

    async def test_directory_removed_and_back(self, tmp_path: Path) -> None:
        """The directory going and coming back is reported, and the new one is watched."""
        target = tmp_path / "a" / "b" / "device-plugins"
        target.mkdir(parents=True)
        got = Collector()
        watch = DirWatcher(str(target), got)
        watch.start()
        try:
            shutil.rmtree(tmp_path / "a")
            await got.until(DirEvent("dir-gone"))
            assert not watch.watching
            target.mkdir(parents=True)
            await got.until(DirEvent("dir-back"))
            assert watch.watching
            (target / "kubelet.sock").write_text("")
            await got.until(DirEvent("created", "kubelet.sock"))
        finally:
            watch.close()

    async def test_directory_absent_at_start(self, tmp_path: Path) -> None:
        """Started before the directory exists, it reports the directory's arrival."""
        target = tmp_path / "later"
        got = Collector()
        watch = DirWatcher(str(target), got)
        watch.start()
        try:
            assert not watch.watching
            target.mkdir()
            await got.until(DirEvent("dir-back"))
            (target / "x").write_text("")
            await got.until(DirEvent("created", "x"))
        finally:
            watch.close()

    async def test_files_written_only_when_asked(self, tmp_path: Path) -> None:
        """A file written in place is reported (``written``) by a watcher made with ``contents=True``;
        a plain watcher hears only its creation."""
        (tmp_path / "token").write_text("old")
        plain, contents = Collector(), Collector()
        watches = [DirWatcher(str(tmp_path), plain), DirWatcher(str(tmp_path), contents, contents=True)]
        for watch in watches:
            watch.start()
        try:
            (tmp_path / "token").write_text("new")
            await contents.until(DirEvent("written", "token"))
            (tmp_path / "marker").write_text("")
            seen = await plain.until(DirEvent("created", "marker"))
            assert DirEvent("written", "token") not in seen
        finally:
            for watch in watches:
                watch.close()

    async def test_close_twice(self, tmp_path: Path) -> None:
        """close() is idempotent."""
        watch = DirWatcher(str(tmp_path), Collector())
        watch.start()
        watch.close()
        watch.close()
