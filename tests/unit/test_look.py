"""``base.look``: present, absent, or cannot look; never "absent" for a path out of sight."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ate_devplugd.base.look import Look, look


def test_present_and_absent(tmp_path: Path) -> None:
    (tmp_path / "file").touch()
    assert look(str(tmp_path / "file")) is Look.PRESENT
    assert look(str(tmp_path)) is Look.PRESENT
    assert look(str(tmp_path / "nothing")) is Look.ABSENT
    assert look(str(tmp_path / "file" / "below")) is Look.ABSENT  # ENOTDIR
    assert look("/no\0where") is Look.ABSENT


def test_a_directory(tmp_path: Path) -> None:
    (tmp_path / "file").touch()
    assert look(str(tmp_path), directory=True) is Look.PRESENT
    assert look(str(tmp_path / "file"), directory=True) is Look.ABSENT


def test_a_link_itself(tmp_path: Path) -> None:
    (tmp_path / "dangling").symlink_to(tmp_path / "nothing")
    assert look(str(tmp_path / "dangling")) is Look.ABSENT
    assert look(str(tmp_path / "dangling"), follow=False) is Look.PRESENT


def test_cannot_look(tmp_path: Path) -> None:
    """A loop of links (ELOOP) cannot be looked through; nor, for a user other than root, a directory
    without search permission (EACCES)."""
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    assert look(str(tmp_path / "a")) is Look.CANNOT_LOOK


@pytest.mark.skipif(os.geteuid() == 0, reason="root looks everywhere (test_not_root runs this case as nobody)")
def test_no_search_permission(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    (locked / "inside").mkdir(parents=True)
    locked.chmod(0)
    try:
        assert look(str(locked / "inside")) is Look.CANNOT_LOOK
        assert look(str(locked / "inside"), directory=True) is Look.CANNOT_LOOK
    finally:
        locked.chmod(0o755)
