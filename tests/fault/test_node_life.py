"""A node's life: a random, seeded sequence of real events, and after each one every signal agreeing with it.

The daemon runs as a process (``python -m ate_devplugd run``) on a scratch ``dev_root`` holding a real
kvm node, with a real sd_notify socket (STATUS) and its metrics file, beside the fake container runtime
answering CRI on a unix socket (tests/fakes/cri.py) and, in device-plugin mode, the fake kubelet
(tests/fakes/kubelet.py) or, in DRA mode, the fake DRA kubelet (its process on kubelet.sock, its health
stream held) and the fake API server. The events: kubelet restarted (killed or stopped; its sockets
wiped, or in DRA mode the node's slices deleted, in one of several orders), stopped and started; the
runtime restarted with ``enable_cdi`` toggled, stopped and started; good reloads and refused ones (a
file that does not parse, a restart-only key changed), the file then fixed without a reload; the device
node removed and created again, each with a real kernel uevent; in DRA mode the API server stopped
and started again.

After each event the test knows the truth (``Truth``) and waits, within ``BOUND`` seconds, until every
signal says it: STATUS, the metrics file, the fake kubelet's view, in DRA mode the API server's, and
``ate-devplugd doctor --json`` (run as an operator would, once the others agree; again until it agrees
too: its figure includes its own run, most of a second). Each signal is read again whenever something
could have changed it (a datagram, an inotify event on the metrics file, a kubelet or API server event,
a doctor run ending): no sleeps. Once each has agreed, the cheap ones are read together once more, so a
signal that agreed for a moment and then drifted is caught. The slowest agreement per signal is
printed, with the event it followed.

``ATE_NODE_LIFE_SEED`` replays a sequence (the seed is printed, and named in every failure);
``ATE_NODE_LIFE_EVENTS`` sets its length (25 by default; ``make check`` runs more).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import random
import re
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from ate_devplugd import config as configmod
from ate_devplugd.base.inotify import DirEvent, DirWatcher
from ate_devplugd.config.dra import DraConfig, Layout
from ate_devplugd.node.cdispec import spec_path
from tests.fakes.apiserver import FakeApiServer
from tests.fakes.cri import FakeRuntime
from tests.fakes.dra_kubelet import FakeDraKubelet
from tests.fakes.kubelet import FakeKubelet
from tests.fault.harness import LOADED_WAIT, daemon_log_clean, live_registration
from tests.integration.dra_rig import DRIVER, NODE, short_dir, write_kubeconfig
from tests.integration.test_runtime_cdi import started, stopped
from tests.support import (
    RESOURCE,
    DaemonProcess,
    NotifyReceiver,
    daemon,
    kvm_config,
    kvm_dev_root,
    kvm_uevent,
    make_kvm_node,
    run_cli,
    subprocess_env,
)

SEED = int(os.environ.get("ATE_NODE_LIFE_SEED") or random.SystemRandom().randrange(1 << 30))
EVENTS = int(os.environ.get("ATE_NODE_LIFE_EVENTS") or 25)
#: The most any signal may take to say the truth after an event: generous, since a loaded CI machine
#: gives the daemon a slice of a core; the figures printed are the point.
BOUND = LOADED_WAIT
#: Unit counts a good reload switches between (device-plugin mode).
COUNTS = (4096, 1024, 2048)
#: The devices of DRA mode's slice (``[dra] devices``; a reload that changes it is refused).
DRA_DEVICES = 128

Facts = dict[str, Any]
Event = tuple[str, Callable[[], Awaitable[str]]]


@dataclasses.dataclass
class Truth:
    """What the live system is, as the test made it."""

    kubelet: bool = True
    present: bool = True
    #: Units (device-plugin mode) or devices in the slice (DRA mode).
    count: int = 4096
    #: The enable_cdi of the runtime last heard (its verdict stands while it is away); None: none heard.
    enable_cdi: bool | None = True
    #: The runtime answers now.
    runtime: bool = True
    #: The last reload was refused, and no good one came since.
    refused: bool = False
    good_reloads: int = 0
    refused_reloads: int = 0
    #: The file on disk: "running" (what the daemon runs), "broken" (does not parse) or "restart-only"
    #: (valid, but with a key only a restart applies).
    file: str = "running"
    #: DRA mode: the API server answers (None in device-plugin mode).
    api: bool | None = None
    #: The device needs CDI applied (``cdi = "required"``; always in DRA mode).
    required: bool = False
    #: A second spec defining our name is in the spec directory the runtime reads (ours).
    conflict: bool = False

    def withheld(self) -> str | None:
        """Why a pod would not get the device now were it there (cri.usable), or None. A runtime away
        keeps its verdict; unknown (none heard) withholds a device that needs CDI applied."""
        if self.enable_cdi is None:
            return "cdi-unknown" if self.required else None
        if self.required and not self.enable_cdi:
            return "cdi-not-applied"
        return "spec-conflict" if self.conflict and self.enable_cdi else None

    def facts(self) -> Facts:
        """Each fact as every signal must say it (None: no signal need say it now). ``healthy``: the units
        offered as Healthy (a withheld device's are not)."""
        healthy = self.count if self.present and self.withheld() is None else 0
        return {
            "kubelet": self.kubelet,
            "registered": self.kubelet,
            "present": self.present,
            "healthy": healthy,
            "total": self.count,
            "offered": healthy if self.kubelet else 0,
            # what the API server holds of this node, while it answers
            "published": None if self.api is False else healthy,
            "api": self.api,
            "verdict": {None: "unknown", True: "applied", False: "not_applied"}[self.enable_cdi],
            "withheld": self.withheld() or "no",
            "spec": "spec_conflict" if self.conflict and self.enable_cdi else "ok",
            "refused": self.refused,
            "reloads": (self.good_reloads, self.refused_reloads),
            # doctor finds the daemon the file started, whatever the file says now, and says how it differs
            "config": True,
            "file": self.file,
        }


def disagreements(said: Facts, want: Facts) -> Facts:
    """The facts a signal states wrongly (None on either side: not said, or not to be said now)."""
    return {k: v for k, v in said.items() if v is not None and want.get(k) is not None and v != want[k]}


# -- reading each signal ------------------------------------------------------------------------------


def status_facts(status: str | None, dra: bool) -> Facts:
    """STATUS=: ``ate.dev/kvm: 4096/4096 healthy, registered | cdi: ... | reload refused ...``, or in DRA
    mode ``dra: registered with kubelet, slice published (128 devices) | cdi: ...``."""
    if status is None:
        return {"registered": "no STATUS yet"}
    parts = status.split(" | ")
    cdi = next((p[len("cdi: ") :] for p in parts if p.startswith("cdi: ")), "")
    facts: Facts = {
        "verdict": "applied"
        if " applies CDI (" in cdi
        else "not_applied"
        if " ignores CDI (" in cdi
        else "unknown"
        if cdi.startswith("unknown whether")
        else f"unreadable: {cdi!r}",
        "refused": any(p.startswith("reload refused ") for p in parts[1:]),
        "withheld": next((m[1] for p in parts if (m := re.search(r"withheld: ([a-z-]+)", p))), "no"),
    }
    if dra:
        facts["registered"] = parts[0].startswith("dra: registered with kubelet, ")
        facts["api"] = "slices API server error" not in parts[0]
        m = re.search(r", slice published \((\d+) devices?\)", parts[0])
        no_device = ", slice published (no device offered)" in parts[0]
        facts["published"] = int(m[1]) if m else 0 if no_device else f"not published: {parts[0]!r}"
        return facts
    m = re.match(rf"{re.escape(RESOURCE)}: (\d+)/(\d+) healthy", parts[0])
    facts["registered"] = parts[0].endswith(", registered")
    facts["healthy"] = (0 if facts["withheld"] != "no" else int(m[1])) if m else f"unreadable: {parts[0]!r}"
    if m and int(m[1]) == 0:
        facts["withheld"] = None  # an unhealthy device's part says why it is unhealthy
    facts["total"] = int(m[2]) if m else f"unreadable: {parts[0]!r}"
    return facts


def metrics_facts(path: Path, dra: bool) -> Facts:
    """The metrics file, as node_exporter would read it now."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {"registered": "no metrics file"}
    samples: dict[str, float] = {}
    verdict = "no runtime_cdi series at 1"
    withheld = "no"
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        samples[name] = float(value)
        if name.startswith("ate_devplugd_runtime_cdi{") and float(value) == 1:
            verdict = re.search(r'verdict="([^"]*)"', name)[1]  # type: ignore[index]
        if name.startswith("ate_devplugd_device_withheld{") and float(value) == 1:
            withheld = re.search(r'reason="([^"]*)"', name)[1]  # type: ignore[index]

    def per(metric: str) -> float | str:
        return samples.get(f'ate_devplugd_{metric}{{resource="{RESOURCE}"}}', f"no {metric}")

    # a runtime that applies CDI but cannot resolve our name: the spec_* verdict of the same series
    spec = verdict if verdict.startswith("spec_") else "ok"
    facts: Facts = {
        "present": per("device_present") == 1,
        "verdict": "applied" if spec != "ok" else verdict,
        "spec": spec,
        "withheld": withheld,
        "reloads": (samples.get("ate_devplugd_reloads_total"), samples.get("ate_devplugd_reload_failures_total")),
    }
    if dra:
        facts["registered"] = per("registered") == 1
        facts["published"] = per("advertised_units")
    else:
        facts["registered"] = per("registered") == 1 and per("listandwatch_streams") == 1
        facts["healthy"] = per("healthy_units")
        facts["total"] = per("advertised_units")
    return facts


def kubelet_facts(kubelet: FakeKubelet, up: bool) -> Facts:
    """The fake kubelet's view: whether it holds a live registration, what it offers, the last list."""
    if not up:
        return {"registered": bool(kubelet.endpoints), "offered": 0}
    live = live_registration(kubelet)
    facts: Facts = {"registered": live, "offered": kubelet.allocatable(RESOURCE)}
    if live:
        latest = kubelet.endpoints[RESOURCE].latest
        assert latest is not None
        facts["healthy"] = sum(1 for d in latest.devices if d.health == "Healthy")
        facts["total"] = len(latest.devices)
    return facts


def dra_kubelet_facts(kubelet: FakeDraKubelet) -> Facts:
    """The fake DRA kubelet's view: whether it holds the driver's registration."""
    return {"registered": DRIVER in kubelet.plugins}


def api_facts(api: FakeApiServer, up: bool) -> Facts:
    """The API server's view: the devices of this node's slices (nothing to say while it is down)."""
    if not up:
        return {}
    slices = api.node_slices()
    if not slices:
        return {"published": "no slice"}
    return {"published": sum(len(s["spec"].get("devices") or []) for s in slices)}


def doctor_facts(checks: dict[str, dict[str, str]], truth: Truth) -> Facts:
    """``doctor --json``: the daemon it describes (the one the file started, whatever the file says now:
    broken, or a restart-only change refused), how the file differs from it, and what each check says."""

    def said(check: str) -> tuple[str, str]:
        found = checks.get(check, {})
        return found.get("level", "absent"), found.get("message", "")

    level, message = said("config file")
    file = {"absent": "running"}.get(level) or (
        "broken" if "does not load" in message else "restart-only" if "(restart to apply)" in message else message
    )
    facts: Facts = {
        "config": said("config")[0] == "OK" and "the running daemon's" in said("config")[1],
        "file": file,
        "kubelet": said("kubelet")[0] == "OK",
        "present": said(f"device {RESOURCE}")[0] == "OK",
    }
    level, message = said("runtime cdi")
    facts["verdict"] = {"OK": "applied", "WARN": "unknown"}.get(level, f"{level} {message}")
    if level == "FAIL" and " ignores CDI (" in message:
        facts["verdict"] = "not_applied"
    if not truth.runtime:  # doctor asks the runtime itself: none answers now (the daemon keeps its verdict)
        facts["verdict"] = None if facts["verdict"] == "unknown" else facts["verdict"]
    level, message = said(f"registered {RESOURCE}")
    if m := re.match(r"kubelet offers (\d+) units of it", message):
        facts["registered"], facts["offered"] = True, int(m[1])
    elif message.startswith("kubelet offers no unit of it"):
        facts["offered"] = 0  # kubelet answers, but whether it holds the resource it does not say
    elif level == "OK":
        facts["registered"] = True
    elif message.startswith(("kubelet holds no registration", "registered, but kubelet closed", "not registered")):
        facts["registered"] = False
    else:
        facts["registered"] = f"{level} {message}"
    if truth.api is None:
        message = said(f"socket {RESOURCE}")[1]
        m = re.search(r"(\d+)/(\d+)(?: units)? healthy", message)
        facts["healthy"] = int(m[1]) if m else f"unreadable: {message!r}"
        facts["total"] = int(m[2]) if m else f"unreadable: {message!r}"
        return facts
    facts["api"] = said("apiserver")[0] == "OK"
    if facts["api"]:
        level, message = said(f"slice {RESOURCE}")
        m = re.search(r"published with (\d+) device", message)
        facts["published"] = int(m[1]) if m else 0 if "holds no device" in message else f"{level} {message}"
    return facts


def tail(text: str, lines: int = 80) -> str:
    return "\n".join(text.splitlines()[-lines:])


class Wait:
    """One wait for agreement: the truth, the signals yet to say it, what each said last, and when each
    first agreed (seconds from the wait's start)."""

    def __init__(self, want: Facts, signals: set[str]) -> None:
        self.want = want
        self.pending = set(signals)
        self.said: dict[str, Facts] = {}
        self.agreed: dict[str, float] = {}
        self.began = time.monotonic()

    def look(self, name: str, facts: Facts) -> None:
        self.said[name] = facts
        if not disagreements(facts, self.want):
            self.agreed[name] = time.monotonic() - self.began
            self.pending.discard(name)

    def look_again(self, name: str, facts: Facts) -> None:
        """A signal that agreed, read again: one that no longer does is waited for again."""
        self.said[name] = facts
        if disagreements(facts, self.want):
            self.pending.add(name)
            self.agreed.pop(name, None)


# -- a node's life ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class Figures:
    """Per signal: the agreement times (seconds) and the slowest, with the event it followed."""

    times: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    slowest: dict[str, tuple[float, str]] = dataclasses.field(default_factory=dict)

    def add(self, signal_name: str, seconds: float, event: str) -> None:
        self.times.setdefault(signal_name, []).append(seconds)
        if seconds > self.slowest.get(signal_name, (-1.0, ""))[0]:
            self.slowest[signal_name] = (seconds, event)

    def report(self, label: str) -> str:
        lines = [f"node-life {label}: slowest agreement per signal (ATE_NODE_LIFE_SEED={SEED})"]
        for name, times in sorted(self.times.items()):
            worst, event = self.slowest[name]
            median = sorted(times)[len(times) // 2]
            lines.append(
                f"  {name:8} {1000 * worst:8.1f} ms  (median {1000 * median:.1f} ms, {len(times)} agreements; "
                f"slowest after {event})"
            )
        return "\n".join(lines)


class Node:
    """The daemon process and the live parts around it, the truth the test made of them, and the wait
    for every signal to say it. A mode's subclass adds its kubelet (and API server), its signals and its
    events."""

    mode = ""

    def __init__(self, base: Path, dev_root: Path, rng: random.Random) -> None:
        self.base = base
        self.dev_root = dev_root
        self.rng = rng
        self.truth = Truth()
        self.plugin_dir = base / "device-plugins"
        self.path = base / "node.toml"
        self.prom = base / "metrics" / "ate-devplugd.prom"
        self.prom.parent.mkdir()
        self.socket = base / "runtime.sock"
        self.notify = NotifyReceiver(base / "notify")
        self.changed = asyncio.Event()
        self.runtime: FakeRuntime | None = None
        self.proc: DaemonProcess | None = None
        self.figures = Figures()
        self.history: list[str] = []
        self.last_doctor: dict[str, dict[str, str]] = {}
        #: How long each doctor run took (most of its figure).
        self.doctor_runs: list[float] = []

    # -- what a mode gives ------------------------------------------------------------------------
    def config(self, **changes: Any) -> configmod.Config:
        raise NotImplementedError

    def cheap_signals(self) -> dict[str, Callable[[], Facts]]:
        """STATUS and the metrics file; a mode adds its kubelet's view (and the API server's)."""
        dra = self.mode == "dra"
        return {
            "STATUS": lambda: status_facts(self.status(), dra),
            "metrics": lambda: metrics_facts(self.prom, dra),
        }

    def queues(self) -> list[asyncio.Queue[Any]]:
        """Where the fakes put what happens to them (each wakes the wait)."""
        return [self.notify.received]

    def events(self) -> list[Event]:
        """The events that can happen to the node as it is now (a mode adds its own)."""
        t = self.truth
        if t.file != "running":
            return [("fix-file", self.fix_file), ("reload-good", self.reload_good)]
        out: list[Event] = [("reload-good", self.reload_good), ("reload-refused", self.reload_refused)]
        if not t.runtime:
            out.append(("runtime-start", self.runtime_start))
        else:
            out += [("runtime-restart", self.runtime_restart), ("runtime-stop", self.runtime_stop)]
        out.append(("device-vanish", self.device_vanish) if t.present else ("device-return", self.device_return))
        out.append(("spec-conflict", self.spec_conflict))
        if t.present:  # our spec is on disk while the device is
            out.append(("spec-deleted", self.spec_deleted))
        return out

    @contextlib.asynccontextmanager
    async def parts(self) -> AsyncIterator[None]:
        """The mode's kubelet (and API server) running while the block runs."""
        yield

    def good_change(self) -> tuple[dict[str, Any], str, dict[str, Any]]:
        """A change a reload applies: the config's changes, what to call it, the truth's changes."""
        raise NotImplementedError

    def restart_only_change(self) -> tuple[dict[str, Any], str]:
        raise NotImplementedError

    # -- the files and signals ----------------------------------------------------------------------
    def write(self, **changes: Any) -> None:
        self.path.write_text(configmod.render(self.config(**changes)))

    def status(self) -> str | None:
        return next((f["STATUS"] for f in reversed(self.notify.history) if "STATUS" in f), None)

    async def doctor(self) -> Facts:
        began = time.monotonic()
        _status, out, err = await run_cli("doctor", "--json", "--config", str(self.path))
        self.doctor_runs.append(time.monotonic() - began)
        try:
            checks = {c["check"]: c for c in json.loads(out)["checks"]}
        except (ValueError, KeyError):
            return {"config": f"doctor printed no JSON: {err.strip()[-300:]}"}
        self.last_doctor = checks
        return doctor_facts(checks, self.truth)

    # -- agreement ---------------------------------------------------------------------------------
    async def agree(self, label: str) -> dict[str, float]:
        """Until every signal has said the truth (and the cheap ones all say it at once), within BOUND;
        returns each signal's first agreement, in seconds from now. doctor runs once the cheap ones
        agree (and again until it agrees too)."""
        cheap = self.cheap_signals()
        wait = Wait(self.truth.facts(), {*cheap, "doctor"})
        doctor: asyncio.Task[Facts] | None = None
        try:
            async with asyncio.timeout(BOUND):
                while wait.pending:
                    self.changed.clear()
                    for name in sorted(wait.pending & cheap.keys()):
                        wait.look(name, cheap[name]())
                    if doctor is not None and doctor.done():
                        wait.look("doctor", doctor.result())
                        doctor = None
                    if wait.pending == {"doctor"} and doctor is None:
                        doctor = asyncio.get_running_loop().create_task(self.doctor())
                        doctor.add_done_callback(lambda _: self.changed.set())
                    if wait.pending:
                        await self.changed.wait()
                    else:  # each has agreed: the cheap ones must still, together
                        for name, read in cheap.items():
                            wait.look_again(name, read())
        except TimeoutError:
            raise AssertionError(self.failure(label, wait)) from None
        finally:
            if doctor is not None:
                doctor.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await doctor
        return wait.agreed

    def failure(self, label: str, wait: Wait) -> str:
        """What each signal said that did not agree, and what led there (the seed first)."""
        said = {name: wait.said.get(name, {}) for name in sorted(wait.pending)}
        detail = "\n".join(
            f"  {name}: said {facts or 'nothing yet'}; wrong: {disagreements(facts, wait.want)}"
            for name, facts in said.items()
        )
        return (
            f"node-life {self.mode} ATE_NODE_LIFE_SEED={SEED}: after {label}, not every signal said the truth "
            f"within {BOUND:g} s\n  truth: {wait.want}\n{detail}\n  STATUS: {self.status()}\n"
            f"  doctor's checks (its last run): {self.last_doctor}\n  events before: {self.history[:-1]}\n"
            f"daemon log (its end):\n{tail(self.proc.log() if self.proc else '')}"
        )

    @contextlib.asynccontextmanager
    async def watching(self) -> AsyncIterator[None]:
        """Wake ``agree`` on every datagram, metrics file write and fake's event."""

        async def pump(queue: asyncio.Queue[Any]) -> None:
            while True:
                await queue.get()
                self.changed.set()

        def on_files(events: list[DirEvent]) -> None:
            self.changed.set()

        watch = DirWatcher(str(self.prom.parent), on_files)
        watch.start()
        loop = asyncio.get_running_loop()
        pumps = [loop.create_task(pump(queue)) for queue in self.queues()]
        try:
            yield
        finally:
            watch.close()
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)

    # -- the events every mode has --------------------------------------------------------------------
    async def runtime_restart(self) -> str:
        assert self.runtime is not None and self.truth.enable_cdi is not None and self.truth.runtime
        enable = not self.truth.enable_cdi
        await stopped(self.runtime)
        self.runtime = await started(self.socket, enable, [self.config().cdi_dir])
        self.truth.enable_cdi = enable
        return f"runtime-restart (enable_cdi = {str(enable).lower()})"

    async def runtime_stop(self) -> str:
        assert self.runtime is not None
        await stopped(self.runtime)
        self.runtime = None
        self.truth.runtime = False  # its verdict stands until it answers again
        return "runtime-stop"

    async def runtime_start(self) -> str:
        enable = self.rng.random() < 0.5
        self.runtime = await started(self.socket, enable, [self.config().cdi_dir])
        self.truth.enable_cdi, self.truth.runtime = enable, True
        return f"runtime-start (enable_cdi = {str(enable).lower()})"

    async def reload_good(self) -> str:
        assert self.proc is not None
        changes, what, truth = self.good_change()
        self.write(**changes)
        await self.proc.signal(signal.SIGHUP)
        self.truth = dataclasses.replace(
            self.truth, refused=False, good_reloads=self.truth.good_reloads + 1, file="running", **truth
        )
        return f"reload-good ({what})"

    async def reload_refused(self) -> str:
        assert self.proc is not None
        if self.rng.random() < 0.5:
            self.path.write_text(self.path.read_text() + "log_level = [\n")
            what, file = "a file that does not parse", "broken"
        else:
            changes, what = self.restart_only_change()
            self.write(**changes)
            file = "restart-only"
        await self.proc.signal(signal.SIGHUP)
        self.truth = dataclasses.replace(
            self.truth, refused=True, refused_reloads=self.truth.refused_reloads + 1, file=file
        )
        return f"reload-refused ({what})"

    async def fix_file(self) -> str:
        self.write()
        self.truth.file = "running"
        return "fix-file (the running config written back, no reload)"

    async def spec_conflict(self) -> str:
        """A second spec defining ate.dev/kvm=kvm dropped into the runtime's spec directory, or removed."""
        other = Path(self.config().cdi_dir) / "other.json"
        if self.truth.conflict:
            other.unlink()
        else:
            node = {"path": "/dev/kvm", "type": "c", "major": 10, "minor": 232}
            device = {"name": "kvm", "containerEdits": {"deviceNodes": [node]}}
            other.write_text(json.dumps({"cdiVersion": "0.6.0", "kind": RESOURCE, "devices": [device]}))
        self.truth.conflict = not self.truth.conflict
        return "spec-conflict (added)" if self.truth.conflict else "spec-conflict (removed)"

    async def spec_deleted(self) -> str:
        """Our own spec removed (an operator, a cleanup tool): written back at once, nothing withheld, so
        every signal still says what it said (the agreement after this event checks that)."""
        cfg = self.config()
        path = Path(spec_path(cfg.cdi_dir, cfg.devices[0]))
        back = asyncio.Event()
        watch = DirWatcher(str(path.parent), lambda _: back.set() if path.exists() else None)
        watch.start()
        try:
            path.unlink()
            began = time.monotonic()
            async with asyncio.timeout(BOUND):
                while not path.exists():
                    await back.wait()
                    back.clear()
        except TimeoutError:
            raise AssertionError(f"node-life: our spec {path} was not written back within {BOUND:g} s") from None
        finally:
            watch.close()
        return f"spec-deleted (written back in {1000 * (time.monotonic() - began):.0f} ms)"

    async def device_vanish(self) -> str:
        (self.dev_root / "dev" / "kvm").unlink()
        await asyncio.to_thread(kvm_uevent)
        self.truth.present = False
        return "device-vanish"

    async def device_return(self) -> str:
        make_kvm_node(self.dev_root)
        await asyncio.to_thread(kvm_uevent)
        self.truth.present = True
        return "device-return"

    # -- a life ---------------------------------------------------------------------------------------
    async def live(self, events: int) -> str:
        """``events`` random events, each followed by the wait for agreement; returns the figures."""
        began = time.monotonic()
        self.runtime = await started(self.socket, True, [self.config().cdi_dir])
        env = subprocess_env(NOTIFY_SOCKET=str(self.notify.path))
        try:
            async with self.parts():
                self.write()
                async with daemon(self.path, env=env) as proc, self.watching():
                    self.proc = proc
                    start = await self.agree("the start")
                    for index in range(1, events + 1):
                        name, action = self.rng.choice(self.events())
                        label = f"event {index} of {events}: {name}"
                        try:
                            label = f"event {index} of {events}: {await action()}"
                        except Exception as exc:
                            exc.add_note(f"node-life {self.mode} ATE_NODE_LIFE_SEED={SEED}: during {label}")
                            raise
                        self.history.append(label.split(": ", 1)[1])
                        for signal_name, seconds in (await self.agree(label)).items():
                            self.figures.add(signal_name, seconds, label)
                    assert await proc.stop() == 0, proc.log()
                    daemon_log_clean(proc.log())
        finally:
            if self.runtime is not None:
                await self.runtime.stop()
            await self.notify.close()
        took = time.monotonic() - began
        runs = sorted(self.doctor_runs)
        started_in = ", ".join(f"{name} {1000 * s:.0f} ms" for name, s in sorted(start.items()))
        return (
            f"{self.figures.report(f'{self.mode}, {events} events in {took:.0f} s')}\n"
            f"  (at the start, from the daemon's launch: {started_in}; doctor ran {len(runs)} times, "
            f"{1000 * runs[len(runs) // 2]:.0f} ms median, {1000 * runs[-1]:.0f} ms at most)\n"
            f"  events ({'cdi = required' if self.truth.required else 'cdi = true'}): {'; '.join(self.history)}"
        )


class DevicePluginNode(Node):
    """Device-plugin mode: the fake kubelet; a good reload changes the unit count."""

    mode = "device-plugin"

    def __init__(self, base: Path, dev_root: Path, rng: random.Random) -> None:
        super().__init__(base, dev_root, rng)
        self.plugin_dir.mkdir(mode=0o750)
        self.kubelet = FakeKubelet(self.plugin_dir, seed=SEED)
        #: cdi = "required" (the runtime's CDI toggled then withholds the device) or plain true, by the seed
        self.truth.required = rng.random() < 0.5

    def config(self, **changes: Any) -> configmod.Config:
        count = changes.pop("count", self.truth.count)
        required = self.truth.required
        config = kvm_config(
            self.plugin_dir, self.dev_root, count, metrics_file=self.prom, cdi=True, cdi_required=required
        )
        return dataclasses.replace(config, runtime_socket=str(self.socket), **changes)

    def cheap_signals(self) -> dict[str, Callable[[], Facts]]:
        return {**super().cheap_signals(), "kubelet": lambda: kubelet_facts(self.kubelet, self.truth.kubelet)}

    def queues(self) -> list[asyncio.Queue[Any]]:
        return [*super().queues(), self.kubelet.events]

    @contextlib.asynccontextmanager
    async def parts(self) -> AsyncIterator[None]:
        await self.kubelet.start()
        try:
            yield
        finally:
            await self.kubelet.stop()

    def events(self) -> list[Event]:
        out = super().events()
        if self.truth.file == "running":
            if self.truth.kubelet:
                out += [("kubelet-restart", self.kubelet_restart), ("kubelet-stop", self.kubelet_stop)]
            else:
                out.append(("kubelet-start", self.kubelet_start))
        return out

    def good_change(self) -> tuple[dict[str, Any], str, dict[str, Any]]:
        count = self.rng.choice([c for c in COUNTS if c != self.truth.count])
        return {"count": count}, f"count = {count}", {"count": count}

    def restart_only_change(self) -> tuple[dict[str, Any], str]:
        return {"plugin_dir": str(self.base / "elsewhere")}, "plugin_dir changed"

    def wipe_order(self) -> str:
        order = self.rng.choice(["random", "name", "reversed"])
        self.kubelet.wipe_order = (lambda names: sorted(names, reverse=True)) if order == "reversed" else order
        return order

    async def kubelet_restart(self) -> str:
        order = self.wipe_order()
        graceful = self.rng.random() < 0.3
        await self.kubelet.restart(graceful=graceful)
        return f"kubelet-restart ({'stopped' if graceful else 'killed'}, wipe order {order})"

    async def kubelet_stop(self) -> str:
        graceful = self.rng.random() < 0.5
        await self.kubelet.stop(graceful=graceful)
        self.truth.kubelet = False
        return f"kubelet-stop ({'stopped' if graceful else 'killed: its kubelet.sock left behind'})"

    async def kubelet_start(self) -> str:
        order = self.wipe_order()
        await self.kubelet.start()
        self.truth.kubelet = True
        return f"kubelet-start (wipe order {order})"


class DraNode(Node):
    """DRA mode: the fake DRA kubelet (its process on kubelet.sock, the driver's health stream held) and
    the fake API server; a good reload changes the log level, a refused one ``[dra] devices``."""

    mode = "dra"

    def __init__(self, base: Path, dev_root: Path, rng: random.Random) -> None:
        super().__init__(base, dev_root, rng)
        self.truth = Truth(count=DRA_DEVICES, api=True, required=True)  # DRA hands devices over through CDI only
        self.plugin_dir.mkdir(mode=0o750)
        self.api = FakeApiServer(NODE, token="t0ken")
        self.kubelet = FakeDraKubelet(
            base / "kubelet", on_wipe=self.api.wipe_driver, device_plugin_dir=self.plugin_dir, hold_health=True
        )
        self.kubeconfig = base / "kubeconfig"
        self.log_level = "debug"

    def config(self, **changes: Any) -> configmod.Config:
        devices = changes.pop("devices", DRA_DEVICES)
        # The units layout, set: the facts count devices (the layout the cluster decides is test_dra_layout's).
        dra = DraConfig(
            node_name=NODE,
            kubeconfig=str(self.kubeconfig),
            kubelet_dir=str(self.base / "kubelet"),
            devices=devices,
            sharing=Layout.UNITS,
        )
        config = kvm_config(self.plugin_dir, self.dev_root, metrics_file=self.prom, cdi=True)
        changes.setdefault("log_level", self.log_level)
        return dataclasses.replace(config, runtime_socket=str(self.socket), mode="dra", dra=dra, **changes)

    def cheap_signals(self) -> dict[str, Callable[[], Facts]]:
        return {
            **super().cheap_signals(),
            "kubelet": lambda: dra_kubelet_facts(self.kubelet),
            "API": lambda: api_facts(self.api, bool(self.truth.api)),
        }

    def queues(self) -> list[asyncio.Queue[Any]]:
        return [*super().queues(), self.kubelet.events, self.api.changes]

    @contextlib.asynccontextmanager
    async def parts(self) -> AsyncIterator[None]:
        await self.api.start()
        write_kubeconfig(self.kubeconfig, self.api.url)
        await self.kubelet.start()
        try:
            yield
        finally:
            await self.kubelet.stop()
            await self.api.stop()

    def events(self) -> list[Event]:
        out = super().events()
        if self.truth.file == "running":
            if self.truth.kubelet:
                out += [("kubelet-restart", self.kubelet_restart), ("kubelet-stop", self.kubelet_stop)]
            else:
                out.append(("kubelet-start", self.kubelet_start))
            out.append(("api-outage", self.api_stop) if self.truth.api else ("api-back", self.api_start))
        return out

    def good_change(self) -> tuple[dict[str, Any], str, dict[str, Any]]:
        self.log_level = "info" if self.log_level == "debug" else "debug"
        return {}, f"log_level = {self.log_level}", {}

    def restart_only_change(self) -> tuple[dict[str, Any], str]:
        return {"devices": DRA_DEVICES // 2}, f"[dra] devices = {DRA_DEVICES // 2}"

    async def kubelet_start_wiping(self) -> str:
        """kubelet's start deletes the node's slices: before its plugin watcher starts, or after."""
        if self.rng.random() < 0.5:
            self.api.kubelet_restarted()
            await self.kubelet.start()
            return "slices deleted, then the plugin watcher started"
        await self.kubelet.start()
        self.api.kubelet_restarted()
        return "plugin watcher started, then the slices deleted"

    async def kubelet_restart(self) -> str:
        await self.kubelet.stop()
        return f"kubelet-restart ({await self.kubelet_start_wiping()})"

    async def kubelet_stop(self) -> str:
        await self.kubelet.stop()
        self.truth.kubelet = False
        return "kubelet-stop"

    async def kubelet_start(self) -> str:
        what = await self.kubelet_start_wiping()
        self.truth.kubelet = True
        return f"kubelet-start ({what})"

    async def api_stop(self) -> str:
        await self.api.stop()
        self.truth.api = False
        return "api-outage (the API server stopped)"

    async def api_start(self) -> str:
        await self.api.start()
        self.truth.api = True
        return "api-back (the API server started again, its store kept)"


@pytest.mark.figures
@pytest.mark.budget(max(300, 6 * EVENTS))
async def test_device_plugin_mode(tmp_path: Path) -> None:
    """The daemon in device-plugin mode through ``EVENTS`` random events: STATUS, the metrics file,
    doctor and kubelet agree with the node after each, within BOUND; the slowest agreement per signal
    is printed."""
    print(f"node-life device-plugin: ATE_NODE_LIFE_SEED={SEED} ATE_NODE_LIFE_EVENTS={EVENTS}")
    node = DevicePluginNode(tmp_path, kvm_dev_root(tmp_path), random.Random(SEED))
    print(await node.live(EVENTS))


@pytest.mark.figures
@pytest.mark.budget(max(300, 6 * EVENTS))
async def test_dra_mode() -> None:
    """The daemon in DRA mode through ``EVENTS`` random events (the API server's outages among them):
    STATUS, the metrics file, doctor, kubelet and the API server agree with the node after each, within
    BOUND; the slowest agreement per signal is printed."""
    print(f"node-life dra: ATE_NODE_LIFE_SEED={SEED} ATE_NODE_LIFE_EVENTS={EVENTS}")
    async with short_dir() as base:
        node = DraNode(base, kvm_dev_root(base), random.Random(SEED))
        print(await node.live(EVENTS))
