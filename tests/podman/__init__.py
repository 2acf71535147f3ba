"""podman as a CDI consumer: real containers that open a device node, with CDI specs from a directory of our own.

Everything lives in one directory per test session: a ``containers.conf`` (runc, cgroupfs, file events,
fixed ulimits: crun and podman's defaults do not work on these hosts), a throwaway store (``--root``,
``--runroot``, ``--tmpdir``, the ``vfs`` driver so no overlay mount outlives a run), and an image made
here and imported (no registry is reachable): one static program, ``kvmcheck.c``, which prints what the
container's process sees of a node as one JSON line and, when ``/dev/kvm`` opens, boots a tiny guest
through it (``KVM_CREATE_VM``, one memory slot, one vCPU, ``KVM_RUN``) and reports what the guest wrote.

Podman 4.3.1 reads CDI specs only from ``/etc/cdi`` and ``/var/run/cdi`` (no flag, no containers.conf key).
So that a test can use the real kind (``ate.dev/kvm``) without touching, or being disturbed by, specs on
the host, a run given ``spec_dir`` happens in a private mount namespace where that directory is bound
over ``/var/run/cdi`` and an empty tmpfs covers ``/etc/cdi`` (if it exists). The one trace left on the
host is the empty mount point ``/var/run/cdi``, CDI's standard directory, created if missing.

The checker runs as root in the container and drops to ``run_as`` itself: podman gives a node whose spec
names no owner to the ``--user`` uid/gid, so a container started as the target user would open the node
whatever the spec's mode, and a test of the mode could not fail.

Where podman cannot run, :func:`require` skips, or fails with the reason when ``ATE_REQUIRE_PODMAN=1``
(``make test`` sets it).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import shutil
import subprocess
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import pytest

#: Set to 1 where the tests must not skip for want of podman (``make test``).
REQUIRE_ENV = "ATE_REQUIRE_PODMAN"
CHECKER_SOURCE = Path(__file__).resolve().parent / "kvmcheck.c"
#: What the checker's guest writes to its I/O port before it halts (GUEST_TEXT in kvmcheck.c).
GUEST_TEXT = "kvm guest: hello from real mode\n"
#: KVM_EXIT_HLT (linux/kvm.h): the guest ran to its ``hlt``.
KVM_EXIT_HLT = 5
IMAGE = "localhost/ate-kvmcheck:test"
#: CDI's directories, as podman 4.3.1 reads them (lowest priority first).
CDI_DIRS = ("/etc/cdi", "/var/run/cdi")
#: podman's exit statuses for its own errors, before any container ran (126: e.g. unresolvable CDI devices).
PODMAN_OWN_ERRORS = (125, 126)
RUN_TIMEOUT = 30.0
CONTAINERS_CONF = """\
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
"""
# Binds the spec directory ($0) over /var/run/cdi and hides /etc/cdi, then becomes the podman command.
_PRIVATE_CDI = """\
set -e
mount --bind "$0" /var/run/cdi
if [ -d /etc/cdi ]; then mount -t tmpfs -o mode=0755,size=64k none /etc/cdi; fi
exec "$@"
"""
_IN_PRIVATE_MOUNTS = ("unshare", "--mount", "--propagation", "private", "--", "sh", "-c", _PRIVATE_CDI)

T = TypeVar("T")


class PodmanUnavailable(Exception):
    """podman cannot run containers here; the message says why."""


class PodmanRunError(Exception):
    """``podman run`` failed before the checker printed its line (e.g. a CDI device it could not resolve)."""

    def __init__(self, argv: Sequence[str], returncode: int, stdout: str, stderr: str) -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr
        super().__init__(f"podman exited {returncode}: {self.error}; CDI: {self.cdi_reason or '-'}")

    @property
    def error(self) -> str:
        """Podman's own one-line error (``Error: ...``), the last one it printed."""
        lines = [line for line in self.stderr.splitlines() if line.startswith("Error: ")]
        return lines[-1].removeprefix("Error: ") if lines else self.stderr.strip()[-500:]

    @property
    def cdi_reason(self) -> str | None:
        """Why the CDI registry refused a spec (podman logs it only at debug level: a failed run is repeated so)."""
        marker = "refreshing the CDI registry: "
        for line in self.stderr.splitlines():
            if marker in line:
                text = _logfmt_msg(line)
                return " ".join(text.split(marker, 1)[1].split())
        return None


def _logfmt_msg(line: str) -> str:
    """The ``msg="..."`` value of a logrus text line, unquoted."""
    start = line.find('msg="')
    if start < 0:
        return line
    quoted = line[start + 4 :]
    try:
        return str(json.JSONDecoder().raw_decode(quoted)[0])
    except ValueError:
        return quoted


@dataclass(frozen=True)
class NodeStat:
    """A device node as ``stat`` shows it: permission bits, owner, and the device number."""

    mode: int
    uid: int
    gid: int
    major: int
    minor: int

    @classmethod
    def of(cls, path: str | os.PathLike[str]) -> NodeStat:
        st = os.stat(path)
        return cls(st.st_mode & 0o7777, st.st_uid, st.st_gid, os.major(st.st_rdev), os.minor(st.st_rdev))


@dataclass(frozen=True)
class GuestRun:
    """The checker's tiny VMM: the step that failed (with its errno), or what the guest wrote and how it stopped."""

    failed_step: str | None  # e.g. "KVM_CREATE_VM"; None: every step worked and KVM_RUN ran
    errno: int
    exit_reason: int  # the last KVM_EXIT_* (-1: KVM_RUN never returned an exit)
    exits: int
    output: str

    @property
    def booted(self) -> bool:
        """The guest ran its code to the end: it wrote the whole text and halted."""
        return self.failed_step is None and self.exit_reason == KVM_EXIT_HLT and self.output == GUEST_TEXT


@dataclass(frozen=True)
class KvmCheck:
    """What the checker saw in the container; ``open_errno`` 0 means the node opened read-write."""

    node: NodeStat | None  # None: no such node in the container (stat_errno says why)
    stat_errno: int
    cgroup_devices: tuple[str, ...] | None  # the cgroup v1 device rules; None where not readable
    uid: int
    gid: int
    groups: tuple[int, ...]
    open_errno: int
    api_version: int | None  # KVM_GET_API_VERSION, when the node opened
    guest: GuestRun | None  # the tiny VMM's run, when KVM_GET_API_VERSION answered
    raw: dict[str, Any]

    @property
    def opened(self) -> bool:
        return self.open_errno == 0

    @property
    def open_error(self) -> str:
        """The open errno by name (``EACCES``), or ``ok``."""
        return errno.errorcode.get(self.open_errno, str(self.open_errno)) if self.open_errno else "ok"

    @classmethod
    def parse(cls, line: str) -> KvmCheck:
        data = json.loads(line)
        if "drop_errno" in data:
            raise ValueError(f"kvmcheck could not drop privileges: {os.strerror(data['drop_errno'])}")
        st = data["stat"]
        rules = data["cgroup_devices"]
        vm = data["vm"]
        guest = GuestRun(vm["failed_step"], vm["errno"], vm["exit_reason"], vm["exits"], vm["output"]) if vm else None
        return cls(
            node=NodeStat(st["mode"], st["uid"], st["gid"], st["major"], st["minor"]) if st else None,
            stat_errno=data.get("stat_errno", 0),
            cgroup_devices=tuple(rules) if rules is not None else None,
            uid=data["uid"],
            gid=data["gid"],
            groups=tuple(data["groups"]),
            open_errno=data["open_errno"],
            api_version=data["api_version"],
            guest=guest,
            raw=data,
        )


def kvm_spec(
    *,
    kind: str = "ate.dev/kvm",
    name: str = "kvm",
    version: str = "0.3.0",
    path: str = "/dev/kvm",
    file_mode: int | None = 0o666,
    uid: int | None = 0,
    gid: int | None = 0,
    permissions: str | None = "rw",
    node: NodeStat | None = None,
    node_extra: dict[str, Any] | None = None,
    edits_extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A CDI spec of one device with one character node, its major:minor read from the host (or ``node``).

    A field given as None is left out; ``node_extra`` and ``edits_extra`` add (or override) raw fields of
    the device node and of the device's containerEdits, for tests of what a consumer refuses.
    """
    host = node or NodeStat.of(path)
    dev: dict[str, Any] = {"path": path, "type": "c", "major": host.major, "minor": host.minor}
    for key, value in (("permissions", permissions), ("fileMode", file_mode), ("uid", uid), ("gid", gid)):
        if value is not None:
            dev[key] = value
    dev.update(node_extra or {})
    edits: dict[str, Any] = {"deviceNodes": [dev], **(edits_extra or {})}
    return {"cdiVersion": version, "kind": kind, "devices": [{"name": name, "containerEdits": edits}]}


def write_spec(spec_dir: Path, spec: dict[str, Any], name: str = "ate.dev-kvm.json") -> Path:
    """Write ``spec`` as JSON into ``spec_dir`` (renamed into place, as a consumer must never read half a file)."""
    spec_dir.mkdir(parents=True, exist_ok=True)
    path = spec_dir / name
    tmp = spec_dir / f".{name}.tmp"
    tmp.write_text(json.dumps(spec, indent=2) + "\n")
    tmp.rename(path)
    return path


def unavailable_reason() -> str | None:
    """Why podman cannot run our containers here (a missing part), or None."""
    if os.geteuid() != 0:
        return "the podman tests need root (rootful podman, mknod'ed device nodes, a private mount namespace)"
    missing = [tool for tool in ("podman", "runc", "conmon", "gcc", "unshare", "mount") if not _which(tool)]
    if missing:
        return f"not installed: {', '.join(missing)} (apt-get install podman runc gcc libc6-dev)"
    if not Path("/dev/kvm").exists():
        return "/dev/kvm does not exist (no kvm module)"
    return None


def _which(tool: str) -> str | None:
    return shutil.which(tool, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))


def require(make: Callable[[], T]) -> T:
    """``make()`` a podman harness, or skip the test saying why; with ATE_REQUIRE_PODMAN=1, fail instead."""
    reason = unavailable_reason()
    if reason is None:
        try:
            return make()
        except PodmanUnavailable as exc:
            reason = str(exc)
    _give_up(reason)


def _give_up(reason: str) -> NoReturn:
    if os.environ.get(REQUIRE_ENV, "") not in ("", "0"):
        pytest.fail(f"podman cannot run here ({REQUIRE_ENV} is set): {reason}", pytrace=False)
    pytest.skip(f"podman cannot run here: {reason}")


def _version(text: str) -> tuple[int, ...]:
    """``podman version 4.3.1`` -> (4, 3, 1)."""
    word = text.rsplit(maxsplit=1)[-1] if text.split() else ""
    return tuple(int(part) for part in word.split(".") if part.isdigit())


class Podman:
    """rootful podman on a throwaway store, holding the kvmcheck image; :meth:`run` starts one container."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.conf = workdir / "containers.conf"
        self.store = workdir / "store"
        self.checker = workdir / "kvmcheck"
        #: podman's (major, minor, patch): 4.3.1 in Debian 12, 5.4 in Debian 13.
        self.version: tuple[int, ...] = ()

    @classmethod
    def prepare(cls, workdir: Path) -> Podman:
        """Write the config, build the checker, import it as an image, and run it once without devices.

        Raises PodmanUnavailable, with podman's or gcc's own words, where any step fails.
        """
        pm = cls(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        pm.conf.write_text(CONTAINERS_CONF)
        pm.version = _version(
            subprocess.run(["podman", "--version"], capture_output=True, text=True, check=False).stdout
        )
        pm._build_checker()
        pm._import_image()
        argv = pm.argv("run", "--rm", "--network", "none", IMAGE, "/kvmcheck")
        done = subprocess.run(argv, env=pm.env(), capture_output=True, text=True, timeout=RUN_TIMEOUT, check=False)
        lines = done.stdout.strip().splitlines()
        if done.returncode != 0 or not lines:
            raise PodmanUnavailable(f"a container does not start: {_tail(done.stderr)}")
        KvmCheck.parse(lines[-1])
        return pm

    def _build_checker(self) -> None:
        argv = ["gcc", "-static", "-O2", "-Wall", "-Werror", "-o", str(self.checker), str(CHECKER_SOURCE)]
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise PodmanUnavailable(f"cannot build the static checker: {_tail(done.stderr)}")

    def _import_image(self) -> None:
        tar = self.workdir / "image.tar"
        subprocess.run(
            ["tar", "-C", str(self.checker.parent), "--owner=0", "--group=0", "-cf", str(tar), self.checker.name],
            check=True,
        )
        argv = self.argv("import", "--quiet", str(tar), IMAGE)
        done = subprocess.run(argv, env=self.env(), capture_output=True, text=True, timeout=RUN_TIMEOUT, check=False)
        if done.returncode != 0:
            raise PodmanUnavailable(f"podman import failed: {_tail(done.stderr)}")

    def env(self) -> dict[str, str]:
        return {**os.environ, "CONTAINERS_CONF": str(self.conf)}

    def argv(self, *args: str) -> list[str]:
        """A podman command line on this harness's store."""
        return [
            "podman",
            "--root",
            str(self.store / "root"),
            "--runroot",
            str(self.store / "run"),
            "--tmpdir",
            str(self.store / "tmp"),
            "--storage-driver",
            "vfs",
            *args,
        ]

    async def run(
        self,
        *,
        cdi_devices: Iterable[str] = (),
        devices: Iterable[str] = (),
        run_as: tuple[int, int] | None = None,
        user: str | None = None,
        spec_dir: Path | None = None,
        path: str = "/dev/kvm",
        podman_args: Sequence[str] = (),
    ) -> KvmCheck:
        """Run the checker in a fresh container and return what it saw.

        ``cdi_devices`` are CDI names (``ate.dev/kvm=kvm``) and ``devices`` further ``--device`` arguments
        in order (``/dev/kvm``: the node with the host's owner and mode, as a DeviceSpec gives it). ``run_as``
        (uid, gid) is where the checker drops before it opens ``path``; ``user`` is podman's ``--user``.
        With ``spec_dir`` the container sees only that directory's CDI specs (a private mount namespace);
        without it, the host's ``/etc/cdi`` and ``/var/run/cdi``. Raises PodmanRunError if podman fails;
        a run podman refuses is repeated with ``--log-level=debug``, so that the error carries the reason.
        """
        args = ["run", "--rm", "--network", "none"]
        for name in [*cdi_devices, *devices]:
            args += ["--device", name]
        if user is not None:
            args += ["--user", user]
        args += [*podman_args, IMAGE, "/kvmcheck"]
        if run_as is not None:
            args += ["--as", f"{run_as[0]}:{run_as[1]}"]
        args.append(path)
        stdout, stderr, returncode = await self._podman(args, spec_dir)
        if returncode in PODMAN_OWN_ERRORS:
            # Only the debug log says why a CDI spec was dropped. It is asked for only now: at debug level
            # every run that does start a container waits 20 s for conmon ("Exceeded conmon timeout").
            args.insert(0, "--log-level=debug")
            stdout, stderr, returncode = await self._podman(args, spec_dir)
        lines = stdout.strip().splitlines()
        if returncode != 0 or not lines:
            raise PodmanRunError(self.argv(*args), returncode, stdout, stderr)
        return KvmCheck.parse(lines[-1])

    async def _podman(self, args: Sequence[str], spec_dir: Path | None) -> tuple[str, str, int]:
        argv = self.argv(*args)
        if spec_dir is not None:
            os.makedirs(CDI_DIRS[-1], mode=0o755, exist_ok=True)
            argv = [*_IN_PRIVATE_MOUNTS, str(spec_dir), *argv]
        return await _communicate(argv, self.env())


async def _communicate(argv: Sequence[str], env: dict[str, str]) -> tuple[str, str, int]:
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    try:
        async with asyncio.timeout(RUN_TIMEOUT):
            out, err = await proc.communicate()
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    return out.decode(errors="replace"), err.decode(errors="replace"), proc.returncode


def _tail(text: str, lines: int = 5) -> str:
    return " | ".join(text.strip().splitlines()[-lines:]) or "(no output)"
