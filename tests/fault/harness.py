"""Shared pieces of the fault suite: sizes (fast or soak), resource figures of a process, leak checks.

Every fault test takes a baseline of the daemon process once it has settled, applies the fault, waits
for the daemon to settle again (on kubelet events, notify datagrams or inotify, each with a timeout),
then compares: open fds (/proc/PID/fd), threads (/proc/PID/task), resident memory (VmRSS) and the
sockets left in the plugin directory. ``ATE_SOAK=1`` (``make soak``) selects the long versions; the
figures of every check are printed with a ``leak-check`` prefix (``make soak`` runs pytest with -s).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ate_devplugd.kubelet.watch import HELD
from tests.fakes.kubelet import Event, FakeKubelet
from tests.support import RESOURCE, SOCKET

SOAK = os.environ.get("ATE_SOAK", "") not in ("", "0")

#: Allowed growth of resident memory over an episode (fast and soak), in KiB. A leak of one
#: ListAndWatch message (~90 KB) per kubelet restart would exceed it within the fast storm.
RSS_BOUND_KIB = 8 * 1024
#: gRPC keeps a few fds whose number depends on timing (its epoll set, wake-up eventfds, the
#: last subchannel): the count may differ by this much between two settled states, never grow with N.
#: The kubelet watch also holds the last few kubelet.sock files it saw (kubelet_watch.HELD, a fixed
#: number), one of them at any settled state.
FD_SLACK = 3 + HELD - 1
#: gRPC's thread pools grow on demand up to a fixed size; likewise bounded, not growing with N.
THREAD_SLACK = 2
TICKS = os.sysconf("SC_CLK_TCK")


def scale(fast: int, soak: int) -> int:
    return soak if SOAK else fast


#: A bound on each wait of a test that may run with the CPU overcommitted: generous, since the daemon and
#: the fake kubelet then get a tenth of a core between them, late; the figures measured are printed.
LOADED_WAIT = 60.0
#: Busy processes per core for ``cpu_overcommit``: a loaded sandbox node (load average 8-10 on 2 cores).
OVERCOMMIT_PER_CORE = 4


@contextlib.contextmanager
def cpu_overcommit(per_core: int = OVERCOMMIT_PER_CORE) -> Iterator[int]:
    """``per_core`` busy processes per core, at this process's own priority, while the block runs;
    yields their number. The daemon and the fake kubelet then get a share of the CPU, late and in slices,
    as on a loaded node."""
    import subprocess

    count = per_core * (os.cpu_count() or 1)
    # each spins only while this process lives: a test run killed outright leaves no CPU burners behind
    spin = f"while kill -0 {os.getpid()} 2>/dev/null; do :; done"
    spinners = [subprocess.Popen(["/bin/sh", "-c", spin]) for _ in range(count)]
    try:
        yield count
    finally:
        for proc in spinners:
            proc.kill()
        for proc in spinners:
            proc.wait()


@contextlib.contextmanager
def load(kind: str) -> Iterator[str]:
    """The machine as a test runs under it: "idle" (as it is) or "overcommit" (``cpu_overcommit``)."""
    if kind == "idle":
        yield "idle"
        return
    assert kind == "overcommit", kind
    with cpu_overcommit() as count:
        yield f"overcommit ({count} busy processes on {os.cpu_count()} cores)"


@dataclass(frozen=True)
class ProcFigures:
    """What a process holds at one moment."""

    fds: int
    threads: int
    rss_kib: int
    cpu_s: float

    @classmethod
    def of(cls, pid: int) -> ProcFigures:
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        threads = len(os.listdir(f"/proc/{pid}/task"))
        rss = 0
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1])
        return cls(fds, threads, rss, cpu_seconds(pid))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of the process (all threads), from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
        text = fh.read()
    fields = text[text.rindex(")") + 2 :].split()
    # fields[0] is field 3 (state); utime and stime are fields 14 and 15
    return (int(fields[11]) + int(fields[12])) / TICKS


def fd_targets(pid: int) -> list[str]:
    out = []
    for name in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            out.append(os.readlink(f"/proc/{pid}/fd/{name}"))
    return sorted(out)


def sockets_in(directory: Path) -> set[str]:
    """Names of the sockets in ``directory`` (other files are not ours to count)."""
    names = set()
    for entry in directory.iterdir():
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(entry.lstat().st_mode):
                names.add(entry.name)
    return names


def assert_no_leak(
    label: str, pid: int, before: ProcFigures, after: ProcFigures, rounds: int, *, rss_bound_kib: int = RSS_BOUND_KIB
) -> None:
    """The daemon holds no more after ``rounds`` faults than before them; prints the figures."""
    growth = after.rss_kib - before.rss_kib
    print(
        f"leak-check {label}: {rounds} rounds; fds {before.fds}->{after.fds}, threads {before.threads}->"
        f"{after.threads}, RSS {before.rss_kib}->{after.rss_kib} KiB ({growth:+d} KiB, bound {rss_bound_kib}), "
        f"CPU {after.cpu_s - before.cpu_s:.2f} s"
    )
    assert after.fds <= before.fds + FD_SLACK, (label, before, after, fd_targets(pid))
    assert after.threads <= before.threads + THREAD_SLACK, (label, before, after)
    assert growth <= rss_bound_kib, (label, before, after)


def live_registration(kubelet: FakeKubelet, resource: str = RESOURCE) -> bool:
    """kubelet holds a registration for ``resource`` whose stream is open and has delivered a list."""
    endpoint = kubelet.endpoints.get(resource)
    return endpoint is not None and endpoint.streaming and endpoint.latest is not None


async def settled(kubelet: FakeKubelet, *, timeout: float = LOADED_WAIT, quiet: float = 0.5) -> list[Event]:
    """Wait until kubelet has a live registration, then until no event arrives for ``quiet`` seconds.

    Returns the events seen meanwhile. The quiet period is a wait on the event queue with a timeout:
    it proves that nothing more happens, it does not stand in for an event.
    """
    seen: list[Event] = []
    async with asyncio.timeout(timeout):
        while True:
            seen.extend(kubelet.drain())
            if live_registration(kubelet):
                try:
                    seen.append(await kubelet.next_event(timeout=quiet))
                except TimeoutError:
                    return seen
                continue
            seen.append(await kubelet.next_event(timeout=timeout))


def expected_ids(count: int = 4096, prefix: str = "kvm-") -> list[str]:
    return [f"{prefix}{i}" for i in range(count)]


def assert_one_current_registration(kubelet: FakeKubelet, healthy: int = 4096, total: int = 4096) -> None:
    """Exactly one live registration for the resource, with the current IDs and health."""
    assert list(kubelet.endpoints) == [RESOURCE], kubelet.endpoints
    endpoint = kubelet.endpoints[RESOURCE]
    assert endpoint.streaming and endpoint.latest is not None
    assert endpoint.socket_path.endswith("/" + SOCKET)
    ids = [d.ID for d in endpoint.latest.devices]
    assert ids == expected_ids(total)
    assert sum(1 for d in endpoint.latest.devices if d.health == "Healthy") == healthy
    doubles = [e for e in kubelet.history if e.kind == "double-register"]
    assert not doubles, doubles


def around(text: str, marker: str, before: int = 60, after: int = 10) -> str:
    """The lines of ``text`` around the first that holds ``marker`` (what a failed check shows)."""
    lines = text.splitlines()
    at = next((i for i, line in enumerate(lines) if marker in line), len(lines))
    return "\n".join(lines[max(0, at - before) : at + after])


def daemon_log_clean(text: str) -> None:
    """No crash, no unexpected-error path taken, no traceback at all (grpcio's stop noise included)."""
    for marker in ("Traceback", "session-error"):
        at = text.find(marker)
        assert at < 0, text[max(0, at - 1500) : at + 2500]


@contextlib.contextmanager
def read_only_bind(directory: Path) -> Iterator[None]:
    """``directory`` read-only in place (a read-only bind mount over itself), undone on exit."""
    import subprocess

    subprocess.run(["mount", "--bind", str(directory), str(directory)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(directory)], check=True)
        yield
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=True)


@contextlib.contextmanager
def full_tmpfs(directory: Path) -> Iterator[None]:
    """``directory`` a 4 KiB tmpfs, filled up (ENOSPC for the next write), undone on exit."""
    import subprocess

    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", str(directory)], check=True)
    try:
        with contextlib.suppress(OSError):
            (directory / "filler").write_bytes(b"x" * 8192)
        yield
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=True)
