"""The claims of docs/security.md that a test can check, one test each.

Probes run as ``nobody`` (setpriv) with Debian's /usr/bin/python3, in directories ``nobody`` can
traverse, so that only the modes under test stand in the way.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import stat
import subprocess
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from ate_devplugd.kubelet.lock import InstanceLock
from tests.fault.harness import (
    SOCKET,
    assert_one_current_registration,
    daemon_log_clean,
    settled,
)
from tests.support import (
    DaemonProcess,
    NotifyReceiver,
    daemon,
    kvm_dev_root,
    kvm_uevent,
    started_kubelet,
    subprocess_env,
    wait_for_path,
    write_config,
)

NOBODY = 65534
SYSPY = "/usr/bin/python3"
UNIT = Path(__file__).resolve().parents[2] / "packaging" / "ate-devplugd.service"


def as_nobody(code: str, *args: str, stdin: int | None = subprocess.DEVNULL) -> subprocess.Popen[str]:
    if shutil.which("setpriv") is None or os.geteuid() != 0:
        pytest.skip("needs setpriv and root")
    return subprocess.Popen(
        [
            "setpriv",
            f"--reuid={NOBODY}",
            f"--regid={NOBODY}",
            "--clear-groups",
            "--",
            SYSPY,
            "-I",
            "-S",
            "-c",
            code,
            *args,
        ],
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd="/",
    )


def run_as_nobody(code: str, *args: str) -> str:
    """Run ``code`` as nobody; its stdout (one word per probe: ok or the errno name)."""
    proc = as_nobody(textwrap.dedent(code), *args)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    return out.strip()


PROBE = """
import errno, os, socket, sys
def attempt(fn):
    try:
        fn()
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))
    return "ok"
"""


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """A directory nobody can traverse (pytest's own tmp_path is 0700)."""
    path = Path(tempfile.mkdtemp(prefix="ate-security-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def kvm_root(open_tmp: Path) -> Path:
    """dev_root in a directory nobody can traverse."""
    return kvm_dev_root(open_tmp)


async def test_socket_mode_owner_even_with_umask_0(open_tmp: Path, kvm_root: Path) -> None:
    """Our socket is 0600 root whatever the umask (here 0000), and never appears with a wider mode: it
    is made 0600 under a hidden staging name before it is linked to its path; the directory the daemon
    creates is 0750 root."""
    plugin_dir = open_tmp / "device-plugins"
    cfg = write_config(open_tmp / "c.toml", plugin_dir, kvm_root)
    notify = NotifyReceiver(open_tmp / "notify")
    old = os.umask(0)
    try:
        async with daemon(cfg, env=subprocess_env(NOTIFY_SOCKET=str(notify.path))) as proc:
            await notify.wait_for(lambda f: "READY" in f)  # sent once the socket is in place
            st = (plugin_dir / SOCKET).lstat()
            assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == 0
            dst = plugin_dir.stat()
            assert stat.S_IMODE(dst.st_mode) == 0o750 and dst.st_uid == 0
            assert sorted(p.name for p in plugin_dir.iterdir()) == [SOCKET]
            assert await proc.stop() == 0
    finally:
        os.umask(old)
        await notify.close()


async def test_nobody_cannot_reach_the_socket(open_tmp: Path, kvm_root: Path) -> None:
    """Even in a directory anyone may enter (0777 here), nobody cannot connect to our socket (EACCES),
    nor remove or replace it when the directory is kubelet's usual root-only 0750."""
    plugin_dir = open_tmp / "device-plugins"
    plugin_dir.mkdir()
    plugin_dir.chmod(0o777)
    cfg = write_config(open_tmp / "c.toml", plugin_dir, kvm_root)
    async with daemon(cfg) as proc:
        await wait_for_path(plugin_dir / SOCKET)
        code = PROBE + "print(attempt(lambda: socket.socket(socket.AF_UNIX).connect(sys.argv[1])))"
        assert run_as_nobody(code, str(plugin_dir / SOCKET)) == "EACCES"
        plugin_dir.chmod(0o750)
        code = PROBE + textwrap.dedent(
            """
            print(attempt(lambda: os.listdir(sys.argv[1])))
            print(attempt(lambda: os.unlink(sys.argv[1] + "/" + sys.argv[2])))
            print(attempt(lambda: socket.socket(socket.AF_UNIX).bind(sys.argv[1] + "/x.sock")))
            """
        )
        assert run_as_nobody(code, str(plugin_dir), SOCKET).split() == ["EACCES"] * 3
        assert await proc.stop() == 0
        daemon_log_clean(proc.log())


async def test_nobody_cannot_signal_or_trigger_uevents(tmp_path: Path, plugin_dir: Path, dev_root: Path) -> None:
    """nobody cannot signal the daemon (EPERM), nor make the kernel send a uevent (the uevent file is
    root's), nor send on the kernel's uevent netlink group (EPERM)."""
    cfg = write_config(tmp_path / "c.toml", plugin_dir, dev_root)
    async with daemon(cfg) as proc:
        await wait_for_path(plugin_dir / SOCKET)
        code = PROBE + textwrap.dedent(
            """
            pid = int(sys.argv[1])
            print(attempt(lambda: os.kill(pid, 15)))
            print(attempt(lambda: os.kill(pid, 1)))
            print(attempt(lambda: open("/sys/class/misc/kvm/uevent", "w").write("remove")))
            def forge():
                s = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 15)  # NETLINK_KOBJECT_UEVENT
                s.sendto(b"remove@/devices/virtual/misc/kvm\\0ACTION=remove\\0", (0, 1))
            print(attempt(forge))
            """
        )
        assert run_as_nobody(code, str(proc.pid)).split() == ["EPERM", "EPERM", "EACCES", "EPERM"]
        assert proc.proc is not None and proc.proc.returncode is None
        assert await proc.stop() == 0


async def test_nobody_holding_the_lock_name_does_not_stop_the_daemon(
    tmp_path: Path, plugin_dir: Path, dev_root: Path
) -> None:
    """The instance lock is an abstract socket name, which anyone may bind first. Held by nobody it does
    not keep the daemon from starting (a warning says so); held by a second root daemon it does (73)."""
    lock = InstanceLock(str(plugin_dir)).name
    holder = as_nobody(
        "import socket, sys\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "s.bind(bytes.fromhex(sys.argv[1]))\n"
        "s.listen(1)\n"
        "print('held', flush=True)\n"
        "sys.stdin.read()\n",
        lock.hex(),
        stdin=subprocess.PIPE,
    )
    kubelet = await started_kubelet(plugin_dir)
    try:
        assert holder.stdout is not None
        assert (await asyncio.to_thread(holder.stdout.readline)).strip() == "held"
        cfg = write_config(tmp_path / "c.toml", plugin_dir, dev_root)
        async with daemon(cfg) as proc:
            await settled(kubelet)
            assert_one_current_registration(kubelet)
            assert f"held by uid {NOBODY}" in proc.log()
            second = await DaemonProcess(cfg).start()
            assert await second.wait() == 73  # a live socket at our path still stops a second daemon
            assert await proc.stop() == 0
    finally:
        holder.kill()
        holder.communicate()
        await kubelet.stop()


async def test_default_grant_is_rw_without_mknod(tmp_path: Path, plugin_dir: Path, dev_root: Path) -> None:
    """By default Allocate grants the one node with "rw": no "m", so a container cannot mknod copies of it."""
    kubelet = await started_kubelet(plugin_dir)
    cfg = write_config(tmp_path / "c.toml", plugin_dir, dev_root)
    try:
        async with daemon(cfg):
            await settled(kubelet)
            response = await kubelet.allocate("ate.dev/kvm", ["kvm-0", "kvm-1"])
            (container,) = response.container_responses
            assert [(d.host_path, d.container_path, d.permissions) for d in container.devices] == [
                ("/dev/kvm", "/dev/kvm", "rw")
            ]
            assert not container.mounts and not container.envs and not container.annotations
            kvm_uevent()  # a hint changes nothing
    finally:
        await kubelet.stop()


def unit_directives() -> dict[str, list[str]]:
    if not UNIT.exists():
        pytest.skip(f"{UNIT} does not exist")
    out: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        m = re.match(r"([A-Za-z]+)=(.*)", line.strip())
        if m:
            out.setdefault(m.group(1), []).append(m.group(2).strip())
    return out


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("UMask", "0077"),
        ("ProtectSystem", "strict"),
        ("ReadWritePaths", "-/var/lib/kubelet/device-plugins -/run/cdi -/var/lib/prometheus/node-exporter"),
        ("ProtectHome", "yes"),
        ("PrivateTmp", "yes"),
        ("DevicePolicy", "closed"),
        ("DeviceAllow", "/dev/kvm r"),
        ("NoNewPrivileges", "yes"),
        ("CapabilityBoundingSet", ""),
        ("RestrictAddressFamilies", "AF_UNIX AF_NETLINK"),
        ("IPAddressDeny", "any"),
        ("MemoryDenyWriteExecute", "yes"),
        ("ProtectKernelModules", "yes"),
        ("ProtectProc", "invisible"),
        ("SystemCallFilter", "~@privileged @resources"),
        ("NoExecPaths", "/"),
    ],
)
def test_unit_sandbox_as_documented(key: str, value: str) -> None:
    """The sandbox that docs/security.md describes is the one the unit file sets."""
    assert value in unit_directives().get(key, []), (key, unit_directives().get(key))
