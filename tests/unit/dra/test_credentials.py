"""The credentials' files followed with real inotify: a token renewed by rename, in place or by a
swapped symlink is seen; the same bytes written again are not a change."""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from pathlib import Path

import pytest

from ate_devplugd.dra import kubeconfig
from ate_devplugd.dra.credentials import CredentialFiles


def write_kubeconfig(path: Path, token_file: str) -> None:
    doc = {
        "clusters": [{"name": "c", "cluster": {"server": "http://127.0.0.1:1"}}],
        "users": [{"name": "u", "user": {"tokenFile": token_file}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    path.write_text(json.dumps(doc))


def renamed(path: Path, text: str) -> None:
    staging = path.with_name(".new")
    staging.write_text(text)
    os.replace(staging, path)


def in_place(path: Path, text: str) -> None:
    path.write_text(text)


def symlink_swapped(path: Path, text: str) -> None:
    """As kubelet's atomic writer updates a projected volume: a new directory, ``..data`` swapped to it."""
    new = path.parent / f"..{uuid.uuid4().hex[:8]}"
    new.mkdir()
    (new / "token").write_text(text)
    (path.parent / "..data.tmp").symlink_to(new.name)
    os.replace(path.parent / "..data.tmp", path.parent / "..data")


async def changed(files: CredentialFiles, after: int) -> None:
    async with asyncio.timeout(5):
        await files.changed(after)


class TestCredentialFiles:
    @pytest.mark.parametrize("write", [renamed, in_place, symlink_swapped])
    async def test_new_token_seen(self, tmp_path: Path, write: object) -> None:
        """A token file renewed by rename, in place, or behind a swapped ``..data`` symlink is seen at
        once, and the next load reads the new token."""
        tokens = tmp_path / "tokens"
        tokens.mkdir()
        if write is symlink_swapped:
            symlink_swapped(tokens / "token", "one")  # ..data -> ..<x>/token
            (tokens / "token").symlink_to("..data/token")
        else:
            (tokens / "token").write_text("one")
        write_kubeconfig(tmp_path / "kc", "tokens/token")
        files = CredentialFiles(str(tmp_path / "kc"))
        files.start()
        try:
            assert files.load().headers["Authorization"] == "Bearer one"
            generation = files.generation
            write(tokens / "token", "two")  # type: ignore[operator]
            await changed(files, generation)
            assert files.load().headers["Authorization"] == "Bearer two"
        finally:
            files.close()

    async def test_same_bytes_are_no_change(self, tmp_path: Path) -> None:
        """Events whose files still hold what was read change nothing; a changed kubeconfig does."""
        (tmp_path / "token").write_text("one")
        write_kubeconfig(tmp_path / "kc", "token")
        files = CredentialFiles(str(tmp_path / "kc"))
        files.start()
        try:
            files.load()
            renamed(tmp_path / "token", "one")
            (tmp_path / "other").write_text("x")
            write_kubeconfig(tmp_path / "kc", "token")  # the same bytes again
            for watcher in files._watchers.values():
                watcher.read_pending()  # the events those writes queued, handled now
            assert files.generation == 0
            write_kubeconfig(tmp_path / "kc", "./token")
            await changed(files, 0)
            assert files.generation == 1
        finally:
            files.close()

    def test_a_load_that_reads_new_bytes_is_a_change(self, tmp_path: Path) -> None:
        """Without a watch (or before its event is handled), a load that reads another token raises the
        generation, so a client made from the earlier load is made again."""
        (tmp_path / "token").write_text("one")
        write_kubeconfig(tmp_path / "kc", "token")
        files = CredentialFiles(str(tmp_path / "kc"))
        files.load()
        files.load()
        assert files.generation == 0
        (tmp_path / "token").write_text("two")
        assert files.load().headers["Authorization"] == "Bearer two"
        assert files.generation == 1

    async def test_token_file_written_later(self, tmp_path: Path) -> None:
        """A token file (and its directory) that does not exist yet is waited for: its arrival is a change."""
        write_kubeconfig(tmp_path / "kc", "tokens/token")
        files = CredentialFiles(str(tmp_path / "kc"))
        files.start()
        try:
            with pytest.raises(kubeconfig.KubeconfigError, match=r"tokenFile: .*token: no such file"):
                files.load()
            (tmp_path / "tokens").mkdir()
            renamed(tmp_path / "tokens" / "token", "one")
            await changed(files, 0)
            assert files.load().headers["Authorization"] == "Bearer one"
        finally:
            files.close()

    async def test_broken_kubeconfig_fixed(self, tmp_path: Path) -> None:
        """A kubeconfig that cannot be used is followed too: the fix is seen."""
        (tmp_path / "kc").write_text("clusters: [")
        files = CredentialFiles(str(tmp_path / "kc"))
        files.start()
        try:
            with pytest.raises(kubeconfig.KubeconfigError) as err:
                files.load()
            assert [path for path, _ in err.value.sources] == [str(tmp_path / "kc")]
            (tmp_path / "token").write_text("one")
            write_kubeconfig(tmp_path / "kc", "token")
            await changed(files, 0)
            assert files.load().headers["Authorization"] == "Bearer one"
        finally:
            files.close()
