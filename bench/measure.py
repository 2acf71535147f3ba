"""Every figure for one runtime: the interpreter running this file, for the daemon, the client and the floors.

    python bench/measure.py [--quick] --out FILE.json

run.py runs this once per runtime and prints the table. The daemon runs as in production: a
subprocess, ``python -m ate_devplugd run``, console logging to a file, Type=notify with a watchdog.
Needs root (mknod, /sys writes) and a kernel with the kvm misc device.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the test harness: tests/support.py

import upgrade  # bench/upgrade.py, beside this file

from ate_devplugd import __version__
from ate_devplugd._pb import api_pb2
from ate_devplugd.config.device import DeviceConfig
from ate_devplugd.deviceplugin import servicer
from ate_devplugd.node.devices import Presence, Resource
from tests.fakes.kubelet import FakeKubelet
from tests.support import (
    DaemonProcess,
    KernelUevents,
    NotifyReceiver,
    Udevd,
    make_kvm_node,
    subprocess_env,
    vm_storm,
)

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
FLOORS = Path(__file__).resolve().parent / "floors.py"
KVM_SYSFS = Path("/sys/class/misc/kvm")
RESOURCE = "ate.dev/kvm"
COUNT = 4096
#: Calls per second of each of the 64 open-loop callers: 640 a second in all, far above what pod
#: admission asks of a plugin, yet well below what one Python gRPC server can answer.
OPEN_LOOP_RATE = 10.0
#: Length of the slices of the idle window (see idle()).
IDLE_SLICE = 10.0
#: Restarts before the ones counted (first connections are slower).
WARM_UP = 5
#: As in the packaged unit (WatchdogSec=30s): a ping every 15 s.
WATCHDOG_USEC = 30_000_000


@dataclass(frozen=True)
class Plan:
    starts: int
    restarts: int
    uevents: int
    allocs: tuple[tuple[int, int], ...]  # (concurrent callers, calls in all)
    open_loop_each: int  # calls per caller, 64 callers at OPEN_LOOP_RATE
    law_reps: tuple[tuple[int, int], ...]  # (count, builds)
    idle: float
    strace: float
    vm_lifecycles: int  # VMs started and stopped per round
    vm_rounds: int
    dra_claims: int  # claims prepared and unprepared before DRA mode's RSS after load
    import_reps: int
    upgrades: int  # old daemon stopped, new one started, each beside the floor's
    upgrade_losses: int  # upgrades (restarts, handovers, guarded ones) per rate and machine, pods arriving


FULL = Plan(
    starts=25,
    restarts=200,
    uevents=100,
    allocs=((1, 2000), (16, 4000), (64, 6400)),
    open_loop_each=30,
    law_reps=((4096, 50), (65536, 8)),
    idle=60.0,
    strace=10.0,
    vm_lifecycles=1000,
    vm_rounds=5,
    dra_claims=500,
    import_reps=3,
    upgrades=15,
    upgrade_losses=5,
)
QUICK = Plan(
    starts=3,
    restarts=10,
    uevents=10,
    allocs=((1, 200), (16, 320), (64, 640)),
    open_loop_each=5,
    law_reps=((4096, 5), (65536, 2)),
    idle=2.0,
    strace=1.0,
    vm_lifecycles=50,
    vm_rounds=1,
    dra_claims=10,
    import_reps=1,
    upgrades=2,
    upgrade_losses=1,
)


def summary(seconds: list[float]) -> dict[str, float]:
    """Median and p99 (nearest rank) in milliseconds."""
    ordered = sorted(seconds)
    n = len(ordered)
    return {
        "n": n,
        "median_ms": round(statistics.median(ordered) * 1000, 3),
        "p99_ms": round(ordered[max(0, math.ceil(0.99 * n) - 1)] * 1000, 3),
        "max_ms": round(ordered[-1] * 1000, 3),
    }


def progress(text: str) -> None:
    print(f"  [{os.environ.get('ATE_BENCH_LABEL', sys.executable)}] {text}", file=sys.stderr, flush=True)


def child_env(**extra: str) -> dict[str, str]:
    drop = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "JOURNAL_STREAM", "INVOCATION_ID")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH", "")]))
    env.update(extra)
    return env


# -- /proc ---------------------------------------------------------------------------------------


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


@dataclass(frozen=True)
class ThreadSample:
    name: str
    cpu_ns: int
    switches: int  # voluntary: each one is the thread going to sleep, so one wake-up follows


def threads(pid: int) -> dict[int, ThreadSample]:
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            cpu_ns = int((task / "schedstat").read_text().split()[0])
            status = (task / "status").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        match = re.search(r"^voluntary_ctxt_switches:\s+(\d+)", status, re.M)
        out[int(task.name)] = ThreadSample(name, cpu_ns, int(match.group(1)) if match else 0)
    return out


# -- the workspace and the daemon ------------------------------------------------------------------


class Workspace:
    """A temp dir with a dev_root holding a real kvm node, a plugin dir, a notify socket and a config."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="ate-bench-"))
        self.dev_root = self.dir / "root"
        (self.dev_root / "dev").mkdir(parents=True)
        self.node = self.dev_root / "dev" / "kvm"
        self.make_node()
        self.plugin_dir = self.dir / "device-plugins"
        self.plugin_dir.mkdir(mode=0o750)
        self.floor_dir = self.dir / "floor-plugins"
        self.floor_dir.mkdir(mode=0o750)
        self.config = self.write_config("config.toml")
        self.notify_path = self.dir / "notify.sock"

    def write_config(
        self, name: str, *, metrics: bool = True, dra: str = "", runtime_socket: Path | None = None
    ) -> Path:
        """The bench's config: the kvm resource with its probe, metrics in the temp dir (or off), CDI
        specs there; ``dra``: the [dra] table (DRA mode, where every device has a CDI spec), and the
        runtime's socket the daemon asks."""
        path = self.dir / name
        metrics_file = self.dir / "ate-devplugd.prom" if metrics else ""
        path.write_text(
            f'plugin_dir = "{self.plugin_dir}"\ndev_root = "{self.dev_root}"\nlog_level = "info"\n'
            f'metrics_file = "{metrics_file}"\ncdi_dir = "{self.dir / "cdi"}"\n'
            + (f'runtime_socket = "{runtime_socket}"\n' if runtime_socket is not None else "")
            + ('mode = "dra"\n' if dra else "")
            + f'\n[[device]]\nresource = "{RESOURCE}"\npath = "/dev/kvm"\ncount = {COUNT}\nprobe = "kvm"\n'
            + ("cdi = true\n\n" + dra if dra else "")
        )
        return path

    def make_node(self) -> None:
        make_kvm_node(self.dev_root)

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


async def spawn_daemon(ws: Workspace, config: Path | None = None) -> DaemonProcess:
    env = subprocess_env(NOTIFY_SOCKET=str(ws.notify_path), WATCHDOG_USEC=str(WATCHDOG_USEC))
    return await DaemonProcess(config or ws.config, env=env, log_level="info").start()


def check_exit(proc: DaemonProcess) -> None:
    assert proc.proc is not None
    if proc.proc.returncode != 0:
        raise RuntimeError(f"the daemon exited {proc.proc.returncode}; log:\n{proc.log()[-4000:]}")


def is_ready(fields: dict[str, str]) -> bool:
    return fields.get("READY") == "1"


async def spawn_floor(*args: str, stdin: int = subprocess.PIPE) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(FLOORS), *args, stdin=stdin, stdout=subprocess.PIPE, env=child_env()
    )
    assert proc.stdout is not None
    async with asyncio.timeout(20):
        line = await proc.stdout.readline()
    if line.strip() != b"up":
        raise RuntimeError(f"floor {args[0]} did not start: {line!r}")
    return proc


async def end_floor(proc: asyncio.subprocess.Process) -> None:
    if proc.stdin is not None:
        proc.stdin.close()
    try:
        async with asyncio.timeout(5):
            await proc.wait()
    except TimeoutError:
        proc.kill()
        await proc.wait()


def write_uevent(action: str = "change") -> float:
    """Ask the kernel for a real uevent for kvm; returns the time just before the write."""
    t = time.monotonic()
    (KVM_SYSFS / "uevent").write_text(action)
    return t


# -- the figures ---------------------------------------------------------------------------------


async def import_ready_once(ws: Workspace, notify: NotifyReceiver) -> float:
    """The floor of a start: a process that imports the libraries, then sends READY=1."""
    notify.forget()
    t0 = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(FLOORS), "import-ready", str(ws.notify_path), env=child_env()
    )
    took = (await notify.wait_stamped(is_ready, 20))[0] - t0
    await proc.wait()
    return took


async def floor_start(ws: Workspace, kubelet: FakeKubelet) -> tuple[float, asyncio.subprocess.Process]:
    """The floor of a start: a process that imports the daemon's libraries, serves one grpc.aio server
    and registers once (floors.py serve-register); the time until kubelet has its Register, and the
    process (still serving)."""
    kubelet.drain()
    t0 = time.monotonic()
    proc = await spawn_floor("serve-register", str(ws.floor_dir))
    try:
        took = (await kubelet.next_event("register", timeout=20)).t - t0
        await kubelet.next_event("list", timeout=20)
    except BaseException:
        await end_floor(proc)
        raise
    return took, proc


async def starts(
    ws: Workspace, reps: int, notify: NotifyReceiver, kubelet: FakeKubelet, floor_kubelet: FakeKubelet
) -> tuple[dict[str, object], dict[str, float], dict[str, float]]:
    """Daemon starts, each one after a run of each floor (imports then READY=1; imports, a server, one
    Register), so that all three see the same machine load."""
    ready, registered, floor, floor_registered = [], [], [], []
    for _ in range(reps):
        floor.append(await import_ready_once(ws, notify))
        took, floor_proc = await floor_start(ws, floor_kubelet)
        floor_registered.append(took)
        await end_floor(floor_proc)
        notify.forget()
        kubelet.drain()
        t0 = time.monotonic()
        proc = await spawn_daemon(ws)
        try:
            ready.append((await notify.wait_stamped(is_ready, 20))[0] - t0)
            registered.append((await kubelet.next_event("register", timeout=20)).t - t0)
            await kubelet.next_event("list", timeout=20)
        finally:
            await proc.stop()
    return {"ready": summary(ready), "registered": summary(registered)}, summary(floor), summary(floor_registered)


async def _handover(
    kubelet: FakeKubelet,
    resource: str | None,
    stop: Callable[[], Awaitable[object]],
    start: Callable[[], Awaitable[object]],
    units: int,
) -> tuple[float, float, float, object]:
    """An upgrade's handover as systemd makes it: the old process stopped (``stop`` returns once it has
    exited), then the new one started. From the stop request: -> the old one gone, -> kubelet has the
    new one's Register, -> its device list with ``units`` healthy (allocatable back)."""
    kubelet.drain()
    t0 = time.monotonic()
    await stop()
    gone = time.monotonic()
    new = await start()
    registered = await kubelet.next_event("register", resource=resource, timeout=20)
    while True:
        listed = await kubelet.next_event("list", resource=resource, timeout=20)
        if listed.healthy == units:
            break
    return gone - t0, registered.t - t0, listed.t - t0, new


async def upgrades(
    ws: Workspace, reps: int, notify: NotifyReceiver, kubelet: FakeKubelet, floor_kubelet: FakeKubelet
) -> tuple[dict[str, object], dict[str, object]]:
    """The upgrade window, ``reps`` times for the daemon and, in turn, for the floor (serve-register:
    the libraries, one server, one Register): the old one stopped, the new one registered, its units
    allocatable again at kubelet."""
    kubelet.drain()
    notify.forget()
    daemon = await spawn_daemon(ws)
    await kubelet.next_event("list", resource=RESOURCE, timeout=20)
    _, floor_proc = await floor_start(ws, floor_kubelet)
    ours: dict[str, list[float]] = {"stopped": [], "registered": [], "allocatable": []}
    floors: dict[str, list[float]] = {"stopped": [], "registered": [], "allocatable": []}

    async def start_floor() -> asyncio.subprocess.Process:
        return await spawn_floor("serve-register", str(ws.floor_dir))

    try:
        for _ in range(reps):
            figures = await _handover(floor_kubelet, None, functools.partial(end_floor, floor_proc), start_floor, 1)
            floor_proc = figures[3]  # type: ignore[assignment]
            for key, value in zip(floors, figures[:3], strict=False):
                floors[key].append(value)
            old = daemon
            figures = await _handover(kubelet, RESOURCE, old.stop, lambda: spawn_daemon(ws), COUNT)
            daemon = figures[3]  # type: ignore[assignment]
            check_exit(old)
            for key, value in zip(ours, figures[:3], strict=False):
                ours[key].append(value)
    finally:
        await daemon.stop()
        await end_floor(floor_proc)
    return {k: summary(v) for k, v in ours.items()}, {k: summary(v) for k, v in floors.items()}


async def _restart_once(kubelet: FakeKubelet, resource: str | None) -> tuple[float, float]:
    """Restart ``kubelet`` (killed and started: kubelet's way); kubelet.sock re-created -> Register
    received, and -> first device list."""
    kubelet.drain()
    await kubelet.restart()
    sock = await kubelet.next_event("socket")
    reg = await kubelet.next_event("register", resource=resource)
    first = await kubelet.next_event("list", resource=resource)
    if resource == RESOURCE and first.healthy != COUNT:
        raise RuntimeError(f"after a restart the device list is {first.healthy}/{first.total}")
    return reg.t - sock.t, first.t - sock.t


async def restarts(ws: Workspace, kubelet: FakeKubelet, reps: int) -> tuple[dict[str, object], dict[str, float]]:
    """kubelet restarts for the daemon, each right after one for the floor (a minimal plugin that
    only re-registers; its socket is left in place), so that both see the same machine load."""
    floor_kubelet = FakeKubelet(ws.floor_dir, wipe=False, lean=True)
    proc = await spawn_floor("register", str(ws.floor_dir))
    registered, listed, floor = [], [], []
    try:
        for i in range(reps + WARM_UP):
            floor_took, _ = await _restart_once(floor_kubelet, None)
            await asyncio.sleep(0.005)
            took, listed_took = await _restart_once(kubelet, RESOURCE)
            if i >= WARM_UP:
                floor.append(floor_took)
                registered.append(took)
                listed.append(listed_took)
            await asyncio.sleep(0.01)
    finally:
        await floor_kubelet.stop()
        await end_floor(proc)
    return {**summary(registered), "listed": summary(listed)}, summary(floor)


def uevent_source() -> str:
    return "udev" if os.path.exists("/run/udev/control") else "kernel"


async def floor_uevent(reps: int) -> dict[str, object]:
    proc = await spawn_floor("uevent-wake", uevent_source())
    assert proc.stdout is not None
    delays = []
    try:
        for _ in range(reps):
            t0 = await asyncio.to_thread(write_uevent)
            async with asyncio.timeout(10):
                woke = 0.0
                while woke < t0:  # skip wake-ups for uevents made elsewhere before ours
                    woke = float(await proc.stdout.readline())
            delays.append(woke - t0)
            await asyncio.sleep(0.005)
    finally:
        proc.kill()
        await proc.wait()
    return {"source": uevent_source(), **summary(delays)}


async def _health_after_uevent(kubelet: FakeKubelet, want: int) -> float:
    """Ask for a kvm uevent; the time until kubelet's list has ``want`` healthy units."""
    t0 = await asyncio.to_thread(write_uevent)
    while True:
        ev = await kubelet.next_event("list", resource=RESOURCE, timeout=2.0)
        if ev.healthy == want:
            return ev.t - t0


async def uevents(ws: Workspace, kubelet: FakeKubelet, reps: int) -> dict[str, object]:
    """Node removed, then a real uevent -> Unhealthy; node back, uevent -> Healthy.

    An event can be lost when udevd starts or stops during the run (the daemon chose its event source
    at start): the node is put back, counted as lost, and the run goes on; three in a row end it.
    """
    gone, back = [], []
    lost = in_a_row = 0
    for _ in range(reps):
        kubelet.drain()
        try:
            ws.node.unlink()
            gone.append(await _health_after_uevent(kubelet, 0))
            ws.make_node()
            back.append(await _health_after_uevent(kubelet, COUNT))
        except TimeoutError:
            lost += 1
            in_a_row += 1
            if not ws.node.exists():
                ws.make_node()
            await asyncio.to_thread(write_uevent)
            if in_a_row == 3:
                break
        else:
            in_a_row = 0
        await asyncio.sleep(0.005)
    if not gone or not back:
        raise RuntimeError(f"the daemon saw none of {reps} uevents (source {uevent_source()})")
    return {"source": uevent_source(), "lost": lost, "unhealthy": summary(gone), "healthy": summary(back)}


async def closed_loop(call: Callable[[], Awaitable[object]], callers: int, total: int) -> dict[str, float]:
    """``callers`` concurrent callers, each issuing its calls one after another; latency of each call."""
    latencies: list[float] = []
    per_caller = max(1, total // callers)

    async def caller() -> None:
        for _ in range(per_caller):
            t = time.perf_counter()
            await call()
            latencies.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(callers)))
    elapsed = time.perf_counter() - t0
    return {**summary(latencies), "calls_per_s": round(len(latencies) / elapsed)}


def allocate_request() -> api_pb2.AllocateRequest:
    return api_pb2.AllocateRequest(container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=["kvm-0"])])


async def open_loop(call: Callable[[], Awaitable[object]], callers: int, rate: float, each: int) -> dict[str, float]:
    """``callers`` independent callers, each calling at random moments ``rate`` times a second on
    average (Poisson arrivals), ``each`` calls apiece: latency when callers do not saturate the server."""
    latencies: list[float] = []
    rng = random.Random(callers)

    async def caller() -> None:
        for _ in range(each):
            await asyncio.sleep(rng.expovariate(rate))
            t = time.perf_counter()
            await call()
            latencies.append(time.perf_counter() - t)

    await asyncio.gather(*(caller() for _ in range(callers)))
    return {**summary(latencies), "offered_calls_per_s": round(callers * rate)}


async def allocate_figures(call: Callable[[], Awaitable[object]], plan: Plan) -> tuple[dict[str, object], int]:
    await closed_loop(call, 4, 200)  # warm-up
    done = 200
    out: dict[str, object] = {}
    for callers, total in plan.allocs:
        out[str(callers)] = await closed_loop(call, callers, total)
        done += total
    out["64-open"] = await open_loop(call, 64, OPEN_LOOP_RATE, plan.open_loop_each)
    done += 64 * plan.open_loop_each
    return out, done


async def allocates(kubelet: FakeKubelet, plan: Plan) -> tuple[dict[str, object], int]:
    stub = kubelet.stub(RESOURCE)
    request = allocate_request()

    async def call() -> None:
        response = await stub.Allocate(request, timeout=10)
        assert response.container_responses[0].devices[0].host_path == "/dev/kvm"

    return await allocate_figures(call, plan)


async def floor_allocates(ws: Workspace, plan: Plan) -> dict[str, object]:
    path = str(ws.dir / "echo.sock")
    proc = await spawn_floor("echo", path)
    payload = allocate_request().SerializeToString()
    out: dict[str, object] = {}
    try:
        async with grpc.aio.insecure_channel("unix://" + path) as channel:
            echo = channel.unary_unary("/bench.Echo/Echo")

            async def call() -> None:
                await echo(payload, timeout=10)

            out, _ = await allocate_figures(call, plan)
    finally:
        await end_floor(proc)
    return out


def list_and_watch(plan: Plan) -> dict[str, object]:
    """One ListAndWatch message as the daemon makes it, in this process: its size, the first build
    for a health state, each later one (any cache the daemon keeps warm), and grpc's encoding of it."""
    cache = servicer.device_list
    out: dict[str, object] = {}
    for count, reps in plan.law_reps:
        resource = Resource(DeviceConfig(resource=RESOURCE, path="/dev/kvm", count=count))
        resource.update(Presence(True, True, "bench"))
        first, again, encodes = [], [], []
        size = 0
        for _ in range(reps):
            cache.cache_clear()
            t = time.perf_counter()
            servicer.list_response(resource)
            first.append(time.perf_counter() - t)
            t = time.perf_counter()
            message = servicer.list_response(resource)
            again.append(time.perf_counter() - t)
            t = time.perf_counter()
            size = len(message.SerializeToString())
            encodes.append(time.perf_counter() - t)
        out[str(count)] = {
            "bytes": size,
            "build": summary(first),
            "rebuild": summary(again),
            "encode": summary(encodes),
        }
    return out


async def floor_rss(ws: Workspace) -> dict[str, int]:
    """RSS of a process that only imports grpc, and of one that loads every library the daemon
    uses and serves one grpc.aio server (and of one that also loads DRA mode's libraries)."""
    out = {}
    sock = str(ws.dir / "rss-floor.sock")
    for name, args in (
        ("import_grpc", ()),
        ("libraries_and_server", (sock,)),
        ("dra_libraries_and_server", (sock, "dra")),
    ):
        proc = await spawn_floor("idle-import" if not args else "idle-libraries", *args)
        try:
            await asyncio.sleep(0.5)
            out[name] = rss_kib(proc.pid)
        finally:
            await end_floor(proc)
    return out


@dataclass
class _Usage:
    """CPU time and wake-ups summed over some idle slices."""

    seconds: float = 0.0
    cpu_ns: int = 0
    switches: dict[str, int] | None = None

    def add(self, pid: int, before: dict[int, ThreadSample], after: dict[int, ThreadSample], seconds: float) -> None:
        self.seconds += seconds
        switches = self.switches if self.switches is not None else {}
        for tid, sample in after.items():
            if tid in before:
                self.cpu_ns += sample.cpu_ns - before[tid].cpu_ns
                name = "main" if tid == pid else sample.name
                switches[name] = switches.get(name, 0) + sample.switches - before[tid].switches
        self.switches = switches

    def per_minute(self) -> dict[str, object]:
        scale = 60.0 / self.seconds if self.seconds else 0.0
        return {
            "window_s": round(self.seconds, 1),
            "cpu_ms_per_min": round(self.cpu_ns / 1e6 * scale, 2),
            "wakeups_per_min": {k: round(v * scale, 1) for k, v in sorted((self.switches or {}).items())},
        }


async def idle(pid: int, window: float, work: Path) -> tuple[dict[str, object], dict[str, object]]:
    """CPU time and wake-ups of every thread while idling (no tracer attached), for the daemon and,
    side by side, for a bare grpc.aio server that serves nothing (the floor).

    Other work on the machine may make misc uevents (test suites do), and each one wakes the daemon
    to re-probe. The window is cut in slices; the figures are summed over the slices in which no
    such uevent arrived, and over the whole window only if every slice had one.
    """
    floor = await spawn_floor("echo", str(work / "idle-floor.sock"))
    watcher = await spawn_floor("uevent-wake", uevent_source())
    assert watcher.stdout is not None
    seen: list[float] = []

    async def read_wakeups() -> None:
        assert watcher.stdout is not None
        while line := await watcher.stdout.readline():
            seen.append(float(line))

    reader = asyncio.get_running_loop().create_task(read_wakeups())
    clean, clean_floor, whole, whole_floor = _Usage(), _Usage(), _Usage(), _Usage()
    slices = max(1, round(window / IDLE_SLICE))
    dirty = 0
    try:
        await asyncio.sleep(0.5)
        for _ in range(slices):
            before, floor_before, t0 = threads(pid), threads(floor.pid), time.monotonic()
            await asyncio.sleep(window / slices)
            after, floor_after, t1 = threads(pid), threads(floor.pid), time.monotonic()
            whole.add(pid, before, after, t1 - t0)
            whole_floor.add(floor.pid, floor_before, floor_after, t1 - t0)
            if any(t0 <= t < t1 for t in seen):
                dirty += 1
            else:
                clean.add(pid, before, after, t1 - t0)
                clean_floor.add(floor.pid, floor_before, floor_after, t1 - t0)
    finally:
        await end_floor(floor)
        watcher.kill()
        reader.cancel()
        await watcher.wait()
    use, use_floor = (clean, clean_floor) if clean.seconds else (whole, whole_floor)
    result = use.per_minute()
    result["misc_uevents_seen"] = len(seen)
    result["slices"] = {"of_s": round(window / slices, 1), "total": slices, "with_foreign_uevents": dirty}
    result["whole_window"] = whole.per_minute()
    return result, use_floor.per_minute()


_STRACE_LINE = re.compile(r"^(\d+)\s+(?:<\.\.\. (\w+) resumed>|(\w+)\()")


async def strace_idle(pid: int, window: float, work: Path) -> dict[str, object]:
    """Which syscalls each thread makes while idle (strace -f attached for ``window`` seconds)."""
    if shutil.which("strace") is None:
        return {"skipped": "strace is not installed"}
    out = work / "strace.txt"
    tracer = await asyncio.create_subprocess_exec(
        "strace", "-f", "-qq", "-o", str(out), "-p", str(pid), stderr=subprocess.DEVNULL
    )
    await asyncio.sleep(window)
    tracer.send_signal(signal.SIGINT)
    await tracer.wait()
    names = {tid: s.name for tid, s in threads(pid).items()}
    calls: dict[str, dict[str, int]] = {}
    for line in out.read_text(errors="replace").splitlines():
        match = _STRACE_LINE.match(line)
        if match is None or line.endswith("<unfinished ...>"):
            continue
        tid = int(match.group(1))
        who = "main" if tid == pid else names.get(tid, str(tid))
        syscall = match.group(2) or match.group(3)
        per = calls.setdefault(who, {})
        per[syscall] = per.get(syscall, 0) + 1
    return {"window_s": window, "syscalls": calls}


async def vm_lifecycles(pid: int, ws: Workspace, plan: Plan, seen: KernelUevents, settle: bool) -> dict[str, object]:
    """The daemon's CPU and main-thread wake-ups while VMs start and stop back to back (a real
    KVM_CREATE_VM loop on the kvm node: each VM makes the kernel announce its start and its end),
    and in a quiet window just as long right after (the floor): ``vm_rounds`` rounds, in turn.

    A round ends once every announcement has reached the bench's own netlink socket and, with udevd
    (``settle``), once udevd has handled them all (udevadm settle), so nothing the daemon might be
    sent is left outside the window.
    """
    busy: list[float] = []
    quiet: list[float] = []
    busy_main: list[float] = []
    quiet_main: list[float] = []
    made_all = 0
    took_all = 0.0
    other_kvm = 0
    for _ in range(plan.vm_rounds):
        before, t0 = threads(pid), time.monotonic()
        announced, others = seen.announcements, len(seen.other_kvm)
        async with vm_storm(ws.node, plan.vm_lifecycles) as storm:
            assert storm.stdout is not None
            made_text, took_text = (await storm.stdout.readline()).split()
        made = int(made_text)
        await seen.wait_announcements(announced + 2 * made)
        if settle:
            await (await asyncio.create_subprocess_exec("udevadm", "settle", "--timeout=60")).wait()
        after, t1 = threads(pid), time.monotonic()
        other_kvm += len(seen.other_kvm) - others
        await asyncio.sleep(t1 - t0)
        rest = threads(pid)
        per_thousand = 1000 / made
        busy.append(_cpu_ms(before, after) * per_thousand)
        quiet.append(_cpu_ms(after, rest) * per_thousand)
        busy_main.append(_switches(pid, before, after) * per_thousand)
        quiet_main.append(_switches(pid, after, rest) * per_thousand)
        made_all += made
        took_all += float(took_text)
    return {
        "lifecycles": made_all,
        "rounds": plan.vm_rounds,
        "uevents_seen": seen.announcements,
        "vm_per_s": round(made_all / took_all) if took_all else 0,
        "window_s_per_1000": round((t1 - t0) * 1000 / made, 2),
        "cpu_ms_per_1000": round(statistics.median(busy), 2),
        "quiet_cpu_ms": round(statistics.median(quiet), 2),
        "quiet_cpu_ms_range": [round(min(quiet), 2), round(max(quiet), 2)],
        "busy_cpu_ms_all": [round(x, 2) for x in busy],
        "main_wakeups_per_1000": round(statistics.median(busy_main), 1),
        "quiet_main_wakeups": round(statistics.median(quiet_main), 1),
        "other_kvm_uevents": other_kvm,
        "lost": seen.lost,
    }


def _cpu_ms(before: dict[int, ThreadSample], after: dict[int, ThreadSample]) -> float:
    return sum(s.cpu_ns - before[t].cpu_ns for t, s in after.items() if t in before) / 1e6


def _switches(pid: int, before: dict[int, ThreadSample], after: dict[int, ThreadSample]) -> int:
    return after[pid].switches - before[pid].switches


async def vm_lifecycles_with_udevd(
    ws: Workspace, plan: Plan, notify: NotifyReceiver, kubelet: FakeKubelet
) -> dict[str, object]:
    """The same with udevd running (the daemon then reads udevd's events, sent after its rules): the
    host's udevd, or one started for this and stopped after (/dev/kvm's owner and mode put back)."""
    if not Udevd.can_start():
        return {"skipped": "udevd is not installed (apt-get install udev)"}
    udevd = Udevd()
    udevd.start()
    seen = KernelUevents()
    try:
        await udevd.ready()
        kubelet.drain()
        notify.forget()
        async with running_daemon(ws, ws.config) as proc:
            await notify.wait_for(is_ready, 20)
            await kubelet.next_event("list", resource=RESOURCE, timeout=20)
            await asyncio.sleep(1.0)
            if "following kernel uevents" in proc.log():
                raise RuntimeError("the daemon did not take udevd's events")
            return {"source": "udev", **await vm_lifecycles(proc.pid, ws, plan, seen, settle=True)}
    finally:
        seen.close()
        udevd.stop()


@contextlib.asynccontextmanager
async def running_daemon(ws: Workspace, config: Path) -> AsyncIterator[DaemonProcess]:
    """A daemon on ``config``, stopped at the end (it must exit 0), killed if the block failed."""
    proc = await spawn_daemon(ws, config)
    try:
        yield proc
        await proc.stop()
        check_exit(proc)
    finally:
        if proc.proc is not None and proc.proc.returncode is None:
            proc.proc.kill()
            await proc.proc.wait()


async def rss_around(pid: int, load: Callable[[], Awaitable[object]]) -> dict[str, int]:
    """RSS once the start has settled, and again after ``load``."""
    await asyncio.sleep(1.0)
    start = rss_kib(pid)
    await load()
    await asyncio.sleep(1.0)
    return {"start_kib": start, "loaded_kib": rss_kib(pid)}


async def import_groups(reps: int) -> dict[str, dict[str, int]]:
    """RSS after each group of the daemon's imports (floors.py import-groups), median of ``reps`` runs,
    for device-plugin mode (then prometheus_client, which it does not load) and for DRA mode."""
    out: dict[str, dict[str, int]] = {}
    for mode in ("dp", "dra"):
        runs: dict[str, list[int]] = {}
        for _ in range(reps):
            proc = await asyncio.create_subprocess_exec(
                sys.executable, str(FLOORS), "import-groups", mode, stdout=subprocess.PIPE, env=child_env()
            )
            stdout, _ = await proc.communicate()
            for line in stdout.decode().splitlines():
                group, kib = line.split("\t")
                runs.setdefault(group, []).append(int(kib))
        out[mode] = {group: round(statistics.median(values)) for group, values in runs.items()}
    return out


async def standard_load(kubelet: FakeKubelet, plan: Plan) -> None:
    """What the measured daemon goes through before its RSS after load: kubelet restarts, then Allocates."""
    for _ in range(plan.restarts + WARM_UP):
        await _restart_once(kubelet, RESOURCE)
    await allocates(kubelet, plan)


async def metrics_off_rss(ws: Workspace, plan: Plan, notify: NotifyReceiver, kubelet: FakeKubelet) -> dict[str, int]:
    """RSS of device-plugin mode with ``metrics_file = ""``: after start, and after the same load."""
    kubelet.drain()
    notify.forget()
    async with running_daemon(ws, ws.write_config("no-metrics.toml", metrics=False)) as proc:
        await notify.wait_for(is_ready, 20)
        await kubelet.next_event("list", resource=RESOURCE, timeout=20)
        return await rss_around(proc.pid, lambda: standard_load(kubelet, plan))


async def dra_rss(ws: Workspace, plan: Plan, notify: NotifyReceiver) -> dict[str, int]:
    """RSS of DRA mode against the fake API server (TLS, a client certificate as kubelet's own) and
    the fake DRA kubelet: after start (registered, slice published), and after ``dra_claims`` claims
    prepared and unprepared one by one (each read from the API server)."""
    from tests.fakes.apiserver import FakeApiServer
    from tests.fakes.certs import make_pki
    from tests.fakes.cri import FakeRuntime, containerd_info
    from tests.fakes.dra_kubelet import FakeDraKubelet
    from tests.integration.dra_rig import NODE, write_kubeconfig

    driver = "kvm.ate.dev"
    pki = make_pki(ws.dir / "pki")
    api = FakeApiServer(NODE, pki=pki)
    await api.start()
    kubeconfig = write_kubeconfig(ws.dir / "kubeconfig", api.url, token=None, pki=pki)
    kubelet_dir = ws.dir / "kubelet"
    dra = (
        f'[dra]\ndriver = "{driver}"\nnode_name = "{NODE}"\nkubeconfig = "{kubeconfig}"\n'
        f'kubelet_dir = "{kubelet_dir}"\n'
        # The claims name the units layout's devices (kvm-N); set, so the figures stay comparable.
        'sharing = "units"\n'
    )
    # The node's runtime applies CDI and reads the bench's cdi_dir: DRA mode offers its devices only then.
    socket = ws.dir / "runtime.sock"
    runtime = await FakeRuntime(socket, "containerd", "2.1.9", containerd_info(True, [str(ws.dir / "cdi")])).start()
    kubelet = FakeDraKubelet(kubelet_dir)
    notify.forget()

    async def claims() -> None:
        for i in range(plan.dra_claims):
            name = f"vm-{i}"
            result = {"request": "kvm", "driver": driver, "pool": f"{NODE}/{RESOURCE}", "device": f"kvm-{i % 128}"}
            claim = ("default", api.add_claim("default", name, [result]), name)
            await kubelet.prepare(driver, claim)
            await kubelet.unprepare(driver, claim)

    try:
        async with running_daemon(ws, ws.write_config("dra.toml", dra=dra, runtime_socket=socket)) as proc:
            await kubelet.start()
            await notify.wait_for(is_ready, 20)
            await kubelet.next_event("registered", timeout=20)
            await notify.wait_for(lambda f: "slice published (128 devices)" in f.get("STATUS", ""), 20)
            rss = await rss_around(proc.pid, claims)
    finally:
        await kubelet.stop()
        await api.stop()
        await runtime.stop()
    return {**rss, "claims": plan.dra_claims}


# -- the run -------------------------------------------------------------------------------------


async def measure(plan: Plan) -> dict[str, object]:
    import google.protobuf

    ws = Workspace()
    results: dict[str, object] = {
        "python": sys.executable,
        "python_version": sys.version.split()[0],
        "grpcio": grpc.__version__,
        "protobuf": google.protobuf.__version__,
        "ate_devplugd": __version__,
    }
    floors: dict[str, object] = {}
    results["floor"] = floors
    notify = NotifyReceiver(ws.notify_path)
    notify.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    # a random wipe order, as kubelet's; no pauses inside its start (they would be counted against the daemon)
    kubelet = FakeKubelet(ws.plugin_dir, lean=True, jitter=0.0)
    proc: DaemonProcess | None = None
    try:
        # Floors first, with no daemon running beside them.
        progress("floors")
        floors["rss_kib"] = await floor_rss(ws)
        floors["import_groups_kib"] = await import_groups(plan.import_reps)
        floors["uevent"] = await floor_uevent(plan.uevents)
        floors["allocate"] = await floor_allocates(ws, plan)
        progress("ListAndWatch messages")
        results["list_and_watch"] = list_and_watch(plan)

        await kubelet.start()
        floor_kubelet = FakeKubelet(ws.floor_dir, wipe=False, lean=True, jitter=0.0)
        await floor_kubelet.start()
        try:
            progress(f"{plan.starts} daemon starts")
            results["start"], floors["imports_ready"], floors["start_registered"] = await starts(
                ws, plan.starts, notify, kubelet, floor_kubelet
            )
            progress(f"{plan.upgrades} upgrades (old stopped, new started)")
            results["upgrade"], floors["upgrade"] = await upgrades(ws, plan.upgrades, notify, kubelet, floor_kubelet)
        finally:
            await floor_kubelet.stop()
        progress(f"{plan.upgrade_losses} restarts, handovers and guarded ones per rate and machine, pods arriving")
        results["upgrade"]["lost"] = await upgrade.losses(ws.dir / "upgrade", ws.dev_root, plan.upgrade_losses)

        progress("one daemon under load")
        kubelet.drain()
        notify.forget()
        proc = await spawn_daemon(ws)
        await notify.wait_for(is_ready, 20)
        await kubelet.next_event("list", resource=RESOURCE, timeout=20)
        await asyncio.sleep(1.0)
        results["rss_start_kib"] = rss_kib(proc.pid)
        progress(f"{plan.restarts} kubelet restarts")
        results["restart"], floors["register"] = await restarts(ws, kubelet, plan.restarts)
        progress(f"{plan.uevents} vanish/return uevents")
        results["uevent"] = await uevents(ws, kubelet, plan.uevents)
        progress("Allocate")
        results["allocate"], allocs_done = await allocates(kubelet, plan)
        await asyncio.sleep(1.0)
        results["rss_loaded_kib"] = rss_kib(proc.pid)
        results["load"] = {"allocates": allocs_done, "kubelet_restarts": plan.restarts + WARM_UP}
        progress(f"idle {plan.idle:.0f} s")
        await asyncio.sleep(1.0)
        results["idle"], floors["idle_grpc_server"] = await idle(proc.pid, plan.idle, ws.dir)
        results["idle_strace"] = await strace_idle(proc.pid, plan.strace, ws.dir)
        progress(f"{plan.vm_rounds} x {plan.vm_lifecycles} VM lifecycles, kernel uevents")
        seen = KernelUevents()
        try:
            lifecycles = {"kernel": {"source": uevent_source(), **await vm_lifecycles(proc.pid, ws, plan, seen, False)}}
        finally:
            seen.close()
        await proc.stop()
        check_exit(proc)
        progress(f"{plan.vm_rounds} x {plan.vm_lifecycles} VM lifecycles, udevd")
        lifecycles["udevd"] = await vm_lifecycles_with_udevd(ws, plan, notify, kubelet)
        results["vm_lifecycles"] = lifecycles
        progress("RSS with metrics off, and in DRA mode")
        results["rss_by_mode"] = {
            "metrics_off": await metrics_off_rss(ws, plan, notify, kubelet),
            "dra": await dra_rss(ws, plan, notify),
        }
    except BaseException:
        if proc is not None:
            sys.stderr.write(proc.log()[-4000:])
        raise
    finally:
        if proc is not None and proc.proc is not None and proc.proc.returncode is None:
            proc.proc.kill()
            await proc.proc.wait()
        await kubelet.stop()
        await notify.close()
        ws.close()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few repetitions, short idle window (a smoke run)")
    parser.add_argument("--out", type=Path, required=True, help="write the results here (JSON)")
    args = parser.parse_args()
    if os.geteuid() != 0 or not (KVM_SYSFS / "dev").exists():
        print("the benchmark needs root (mknod, /sys writes) and the kvm misc device", file=sys.stderr)
        return 2
    results = asyncio.run(measure(QUICK if args.quick else FULL))
    results["mode"] = "quick" if args.quick else "full"
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
