"""The daemon started by a user who may not write its plugin directory: one clear line, exit 77
(EX_NOPERM), no traceback and no READY=1, instead of READY and a wait for ever.

As root the suite runs the daemon as nobody (setpriv, as the Makefile's NOBODY does); as nobody
(`make test-nonroot`) it runs it as itself. Either way in a directory that user can traverse, with the
modes under test the only thing in its way.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import NotifyReceiver, subprocess_env, write_config

NOBODY = 65534


def not_root() -> list[str]:
    """The command prefix that runs the daemon as a user other than root."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv to run the daemon as nobody")
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--"]


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """A directory the daemon's user can traverse (pytest's own tmp_path is 0700)."""
    path = Path(tempfile.mkdtemp(prefix="ate-not-root-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        for sub in path.rglob("*"):
            if sub.is_dir() and not sub.is_symlink():
                sub.chmod(0o755)
        path.chmod(0o755)
        shutil.rmtree(path, ignore_errors=True)


async def start_refused(
    open_tmp: Path, plugin_dir: Path, devices: str | None = None
) -> tuple[int, list[str], list[dict[str, str]]]:
    """Run the daemon as not root on ``plugin_dir``: its exit status, its stderr lines and every sd_notify
    datagram it sent."""
    dev_root = open_tmp / "root"
    (dev_root / "dev").mkdir(parents=True)
    cfg = write_config(open_tmp / "c.toml", plugin_dir, dev_root, devices)
    cfg.chmod(0o644)
    notify = NotifyReceiver(open_tmp / "notify", read=False)
    (open_tmp / "notify").chmod(0o666)
    try:
        proc = await asyncio.create_subprocess_exec(
            *not_root(),
            sys.executable,
            "-m",
            "ate_devplugd",
            "run",
            "--config",
            str(cfg),
            "--log-target",
            "console",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=subprocess_env(NOTIFY_SOCKET=str(notify.path)),
            cwd="/",
        )
        try:
            async with asyncio.timeout(20):
                _, err = await proc.communicate()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        assert proc.returncode is not None
        sent = []
        while True:  # the daemon has exited: all it sent is queued
            try:
                data = notify.sock.recv(65536)
            except BlockingIOError:
                break
            sent.append(dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line))
        return proc.returncode, err.decode().splitlines(), sent
    finally:
        await notify.close()


def assert_one_clear_line(lines: list[str], expected: str) -> None:
    """One error line, the expected one (warnings about the host, such as no udevd, may come before it)."""
    errors = [line for line in lines if not line.startswith(("info:", "debug:", "warning:"))]
    assert errors == [f"error: {expected}; not starting  [event=no-permission]"], lines
    assert not [line for line in lines if "Traceback" in line], lines


@pytest.mark.parametrize("exists", [False, True])
async def test_plugin_dir_under_a_parent_it_cannot_enter(open_tmp: Path, exists: bool) -> None:
    """A plugin directory it cannot look at, there or not: exit 77 with one line naming it, saying it
    cannot look (never "cannot create" a directory that may well exist), no READY."""
    parent = open_tmp / "locked"
    parent.mkdir()
    plugin_dir = parent / "device-plugins"
    if exists:
        plugin_dir.mkdir()
    parent.chmod(0o000)
    status, lines, sent = await start_refused(open_tmp, plugin_dir)
    assert status == os.EX_NOPERM, lines
    uid = NOBODY if os.geteuid() == 0 else os.geteuid()
    assert_one_clear_line(
        lines,
        f"cannot look at {plugin_dir}: permission denied (uid {uid}); ate-devplugd runs as root, "
        "and the directory must be root's",
    )
    assert not [fields for fields in sent if "READY" in fields], sent


async def test_doctor_cannot_look_is_not_absent(open_tmp: Path) -> None:
    """doctor as a user who may not look into the plugin directory does not FAIL kubelet's socket as
    absent: it cannot look, and says so."""
    dev_root = open_tmp / "root"
    (dev_root / "dev").mkdir(parents=True)
    plugin_dir = open_tmp / "locked" / "device-plugins"
    plugin_dir.mkdir(parents=True)
    (plugin_dir / "kubelet.sock").touch()
    (open_tmp / "locked").chmod(0o000)
    cfg = write_config(open_tmp / "c.toml", plugin_dir, dev_root)
    cfg.chmod(0o644)
    proc = await asyncio.create_subprocess_exec(
        *not_root(),
        sys.executable,
        "-m",
        "ate_devplugd",
        "doctor",
        "--json",
        "--config",
        str(cfg),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=subprocess_env(),
        cwd="/",
    )
    async with asyncio.timeout(60):
        out, err = await proc.communicate()
    found = {f["check"]: f for f in json.loads(out)["checks"]}
    assert found["kubelet"]["level"] == "WARN", (out, err)
    assert "cannot look: permission denied; run as root" in found["kubelet"]["message"]


async def test_plugin_dir_it_cannot_write(open_tmp: Path) -> None:
    """A plugin directory that exists but is not writable for it (kubelet's is root's, 0750): exit 77
    with one line, no READY, instead of READY and waiting for ever to serve its socket there."""
    plugin_dir = open_tmp / "device-plugins"
    plugin_dir.mkdir()
    plugin_dir.chmod(0o555)
    status, lines, sent = await start_refused(open_tmp, plugin_dir)
    assert status == os.EX_NOPERM, lines
    uid = NOBODY if os.geteuid() == 0 else os.geteuid()
    assert_one_clear_line(
        lines,
        f"cannot write {plugin_dir}: permission denied (uid {uid}); ate-devplugd runs as root, "
        "and the directory must be root's",
    )
    assert not [fields for fields in sent if "READY" in fields], sent
    assert os.listdir(plugin_dir) == []


async def test_dra_directories_it_cannot_make(open_tmp: Path) -> None:
    """DRA mode's sockets go in kubelet's directory, root's: exit 77 with one line naming the directory it
    could not make, instead of "is another ate-devplugd running?" and 73."""
    kubelet_dir = open_tmp / "kubelet"
    kubelet_dir.mkdir()
    kubelet_dir.chmod(0o555)
    plugin_dir = open_tmp / "device-plugins"
    plugin_dir.mkdir()
    if os.geteuid() == 0:
        os.chown(plugin_dir, NOBODY, NOBODY)
    dra = f'mode = "dra"\n[dra]\nnode_name = "node-1"\nkubelet_dir = "{kubelet_dir}"\n'
    status, lines, sent = await start_refused(
        open_tmp, plugin_dir, dra + '[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\n'
    )
    assert status == os.EX_NOPERM, lines
    uid = NOBODY if os.geteuid() == 0 else os.geteuid()
    assert_one_clear_line(
        lines,
        f"cannot create {kubelet_dir}/plugins: permission denied (uid {uid}); ate-devplugd runs as root, "
        "and the directory must be root's",
    )
    assert not [fields for fields in sent if "READY" in fields], sent
