"""The daemon's check of what the node's container runtime does with our CDI names, following its socket.

``RuntimeCheck`` asks the runtime (``cri.ask.ask``) at start, on reload, when kubelet starts and
whenever the runtime's socket is created again; the socket is the one ``cri.ask.discover`` finds
(ours, else kubelet's, else the usual ones: ``cri.endpoint``), found again at each start. The socket asked
and why are said when they change (``runtime-endpoint``). Each answer also points the spec check
(``cri.conflicts.SpecCheck``) at ``cdi_dir`` and the spec directories the runtime reads (``cdi_dir``
alone where it does not say).

The verdict is state the daemon reads before it serves: ``first_verdict`` waits (bounded by
``FIRST_VERDICT``) for the runtime's answer, or for the sign that none can come (no socket). A verdict
is kept while the runtime is away (its socket gone, or no answer) until it answers again; only where no
runtime has answered since the start (for the socket and ``cdi_dir`` asked) is the verdict ``unknown``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import posixpath
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ate_devplugd.base.backoff import Backoff
from ate_devplugd.base.inotify import DirEvent, DirWatcher, watch_dir
from ate_devplugd.base.logs import EventLog
from ate_devplugd.base.look import Look, look
from ate_devplugd.config.device import DeviceConfig
from ate_devplugd.cri.ask import ask, discover
from ate_devplugd.cri.conflicts import SpecCheck, dirs_to_read
from ate_devplugd.cri.conflicts import status as specs_status
from ate_devplugd.cri.endpoint import DEFAULT_RUNTIME_SOCKETS
from ate_devplugd.cri.facts import CdiVerdict, RuntimeReport, consequence
from ate_devplugd.cri.verdict import HeldVerdict

if TYPE_CHECKING:
    from ate_devplugd.cri.endpoint import Endpoint
    from ate_devplugd.cri.rules import SpecProblem

log = logging.getLogger(__name__)

#: How long after the first inotify event on a runtime socket the runtime is asked: a starting containerd
#: removes its old socket and creates the new one (and its ttrpc socket) within milliseconds, and the
#: whole burst is one question.
SETTLE_DELAY = 0.05
#: A runtime whose socket is there but that answers with an error is asked again, the delays doubling
#: from ``RETRY_FIRST`` up to ``RETRY_CAP``, for ``RETRY_FOR`` seconds: containerd creates its socket
#: before its CRI service has initialized and answers "server is not initialized yet" until it has, and
#: no event marks that moment. After that, only the next event asks again.
RETRY_FIRST = 0.1
RETRY_CAP = 5.0
RETRY_FOR = 60.0
#: How long the start waits for the runtime's first verdict before it serves without one (``unknown``):
#: containerd answers in 3-5 ms; one that hangs must not hold the start.
FIRST_VERDICT = 1.5


class RuntimeCheck:
    """The daemon's question to the runtime: asked at start, on reload, when kubelet starts, and whenever
    the runtime's socket is created again (containerd and CRI-O create theirs anew at every start); on a
    timer only while a runtime that is there gives no answer (see below). Each ask replaces one still
    running. It runs beside everything else on the loop: a runtime that is slow or absent delays only what
    awaits ``first_verdict``, for ``FIRST_VERDICT`` at most. Each new verdict is logged once (a warning
    when the names will not work, info otherwise) and shown in STATUS and the metrics.

    The socket is followed by inotify on its directory (``DirWatcher``, on the loop): the one ``discover``
    named (``runtime_socket``, or kubelet's), else the directory of each usual socket (a directory not
    there yet is waited for from its nearest existing ancestor). The watch is installed before the first
    question, so no start of the runtime falls between the two. When the socket the verdict came from is
    removed, the verdict is kept, marked away (a runtime that restarts comes back with its config, and
    until it does no container is created): only its next answer replaces it. A socket created (or a
    directory back, or lost events) asks again ``SETTLE_DELAY`` after the first event, one question for
    the whole burst. A runtime that is there but answers with an error is asked again on a doubling delay
    for a while (``RETRY_FOR``): no event says when a starting runtime is ready to answer.

    Each verdict carries ``since``: the loop time after which the runtime that gave it started (its socket
    was last seen gone then), so that ``cri.usable`` can tell whether it started after ``cdi_dir`` was
    replaced (its CDI cache then follows the new directory)."""

    def __init__(
        self,
        on_report: Callable[[RuntimeReport | None], None],
        asker: Callable[[str, str], Any] | None = None,
        proc_root: str = "/proc",
    ) -> None:
        self._on_report = on_report
        #: ``cri.ask.ask`` unless a test gives its own.
        self._ask = asker or ask
        self._task: asyncio.Task[None] | None = None
        self._verdict = HeldVerdict()
        self._logged: tuple[CdiVerdict, str, str, bool] | None = None
        #: The verdict last told to the owner.
        self._shown: RuntimeReport | None = None
        self._mode = "device-plugin"
        self._socket = ""
        self._cdi_dir = ""
        self._watched: tuple[str, ...] = ()
        self._watchers: list[DirWatcher] = []
        self._settle: asyncio.TimerHandle | None = None
        self._retry: asyncio.TimerHandle | None = None
        self._retry_until: float | None = None
        self._backoff = Backoff(RETRY_FIRST, RETRY_CAP)
        self._devices: tuple[DeviceConfig, ...] = ()
        #: Made at the first start that is enabled, with the spec check's modules (``cri.conflicts``, ``cri.rules``).
        self._specs: SpecCheck | None = None
        self._proc_root = proc_root
        self._endpoint: Endpoint | None = None

    @property
    def report(self) -> RuntimeReport | None:
        """The verdict (``cri.verdict``); None while the check is off or before its first question ends."""
        return self._verdict.report

    @property
    def watched(self) -> tuple[str, ...]:
        """The sockets whose directories are watched (empty while the check is off)."""
        return self._watched

    @property
    def endpoint(self) -> Endpoint | None:
        """The runtime socket chosen at the last start, and why (None before the first)."""
        return self._endpoint

    @property
    def spec_problems(self) -> tuple[SpecProblem, ...]:
        """Other specs that define our names, and specs of ours that do not load, in the runtime's spec
        directories (empty while the check is off)."""
        return () if self._specs is None else self._specs.problems

    async def first_verdict(self, timeout: float = FIRST_VERDICT) -> RuntimeReport | None:
        """The verdict once one is known for the socket and ``cdi_dir`` asked: the runtime's answer, or
        ``unknown`` where there is no socket to ask or after ``timeout`` without an answer (the question
        goes on, and its answer replaces it). At once while the check is off or a verdict is kept."""
        if self._watched and not self._verdict.known.is_set():
            try:
                async with asyncio.timeout(timeout):
                    await self._verdict.known.wait()
            except TimeoutError:
                self._show(self._verdict.unknown(f"it did not answer within {timeout:g} s"))
        return self._verdict.report

    def status_parts(self) -> list[str]:
        """What STATUS says of the runtime: its verdict once it answered, then any problem with the specs."""
        report = self._verdict.report
        parts = [] if report is None else [f"cdi: {report.status()}"]
        if self._specs is None:
            return parts

        specs = specs_status(self._specs.problems)
        return [*parts, specs] if specs else parts

    def start(
        self, *, socket: str, cdi_dir: str, mode: str, enabled: bool, devices: tuple[DeviceConfig, ...] = ()
    ) -> None:
        """Ask again (or stop asking, when no resource needs CDI: a later verdict is then logged anew);
        ``devices``: those whose names the spec check looks for."""
        self._cancel()
        self._retry_until = None
        if not enabled:
            self._unwatch()
            if self._specs is not None:
                self._specs.close()
            self._logged = None
            self._verdict.forget()
            if self._shown is not None:
                self._shown = None
                self._on_report(None)
            return

        if self._specs is None:
            self._specs = SpecCheck(self._specs_changed)
        endpoint = discover(socket, self._proc_root)
        self._say_endpoint(endpoint)
        self._endpoint = endpoint
        self._mode, self._socket, self._cdi_dir, self._devices = mode, endpoint.socket, cdi_dir, devices
        self._verdict.expect(endpoint.socket, cdi_dir)
        self._watch((endpoint.socket,) if endpoint.named else DEFAULT_RUNTIME_SOCKETS)
        self._task = asyncio.get_running_loop().create_task(
            self._run(endpoint.socket, cdi_dir), name="runtime CDI check"
        )

    async def close(self) -> None:
        task = self._task
        self._cancel()
        self._unwatch()
        if self._specs is not None:
            self._specs.close()
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)

    def _cancel(self) -> None:
        for handle in (self._settle, self._retry):
            if handle is not None:
                handle.cancel()
        self._settle = self._retry = None
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self._task = None

    # -- following the socket ----------------------------------------------------------------------
    def _watch(self, sockets: tuple[str, ...]) -> None:
        """One watch per directory holding one of ``sockets`` (kept when they are the ones watched)."""
        if sockets == self._watched:
            return
        self._unwatch()
        names: dict[str, set[str]] = {}
        for path in sockets:
            directory, name = posixpath.split(posixpath.normpath(path))
            names.setdefault(directory, set()).add(name)
        for directory, wanted_names in names.items():
            watcher = watch_dir(
                directory,
                functools.partial(self._on_dir_events, frozenset(wanted_names)),
                functools.partial(_unwatched, directory),
            )
            if watcher is not None:
                self._watchers.append(watcher)
        self._watched = sockets

    def _unwatch(self) -> None:
        for watcher in self._watchers:
            watcher.close()
        self._watchers = []
        self._watched = ()

    def _on_dir_events(self, names: frozenset[str], events: list[DirEvent]) -> None:
        if not any(ev.name in names if ev.kind in ("created", "removed") else True for ev in events):
            return
        if any(ev.kind == "dir-gone" or (ev.kind == "removed" and ev.name in names) for ev in events):
            self._verdict.gone()
        report = self._verdict.report
        if report is not None and report.answered and look(report.socket) is Look.ABSENT:
            # The runtime the verdict came from is away: no container is created until it is back, and
            # it comes back with its config. The verdict stands until it answers again (cri.verdict).
            self._cancel()
            gone = RuntimeReport(CdiVerdict.UNKNOWN, f"its socket {report.socket} is gone", socket=report.socket)
            self._show(self._verdict.heard(gone))
        if self._settle is None:
            self._settle = asyncio.get_running_loop().call_later(SETTLE_DELAY, self._settled)

    def _settled(self) -> None:
        self._settle = None
        self._cancel()
        self._task = asyncio.get_running_loop().create_task(
            self._run(self._socket, self._cdi_dir), name="runtime CDI check"
        )

    # -- the verdict -------------------------------------------------------------------------------
    async def _run(self, socket: str, cdi_dir: str) -> None:
        answer: RuntimeReport = await self._ask(socket, cdi_dir)
        report = self._verdict.heard(answer)
        self._show(report)
        assert self._specs is not None  # made by start()
        self._specs.start(dirs_to_read(report.spec_dirs, cdi_dir), cdi_dir, self._devices)
        self._retry_if_unanswered(answer)

    def _retry_if_unanswered(self, report: RuntimeReport) -> None:
        """Ask again later while a runtime that is there gives no answer, for ``RETRY_FOR`` at most."""
        loop = asyncio.get_running_loop()
        if not report.unanswered:
            self._retry_until = None
            return
        if self._retry_until is None:
            self._retry_until = loop.time() + RETRY_FOR
            self._backoff.reset()
        if loop.time() < self._retry_until:
            self._retry = loop.call_later(self._backoff.next(), self._asked_again)

    def _asked_again(self) -> None:
        self._retry = None
        self._task = asyncio.get_running_loop().create_task(
            self._run(self._socket, self._cdi_dir), name="runtime CDI check"
        )

    def _say_endpoint(self, endpoint: Endpoint) -> None:
        """Which runtime socket is asked, and why: said when it changes (not for each kubelet pid)."""
        before = self._endpoint
        if before is not None and (before.socket, before.source) == (endpoint.socket, endpoint.source):
            return

        where = endpoint.socket or "the usual sockets " + ", ".join(DEFAULT_RUNTIME_SOCKETS)
        EventLog(log).info(EVENT_ENDPOINT, "cdi: asking %s (%s)", where, endpoint.why)

    def _specs_changed(self) -> None:
        """The spec check found problems, or they are gone: the owner shows them (STATUS)."""
        if self._verdict.report is not None:
            self._on_report(self._verdict.report)

    def _show(self, report: RuntimeReport) -> None:
        """A verdict the held one became: logged when new, and told to the owner when it changed."""
        self._log(report)
        if report != self._shown:
            self._shown = report
            self._on_report(report)

    def _log(self, report: RuntimeReport) -> None:
        key = (report.verdict, report.runtime, report.reason, bool(report.away))
        if key == self._logged:
            return
        self._logged = key
        events = EventLog(log)
        if report.away:
            events.info(
                EVENT_AWAY,
                "cdi: %s is away (%s); its verdict stands until it answers again",
                report.runtime,
                report.away,
            )
        elif report.verdict in (CdiVerdict.NOT_APPLIED, CdiVerdict.DIR_NOT_READ):
            events.warning(EVENT_NOT_APPLIED, "cdi: %s; %s", report.describe(), consequence(report.verdict, self._mode))
        else:
            events.info(EVENT_RUNTIME, "cdi: %s", report.describe())


#: Journal event: the runtime socket asked, and why (when it changes).
EVENT_ENDPOINT = "runtime-endpoint"
#: Journal events: a verdict under which our CDI names will not work, any other verdict, and a runtime
#: gone away whose verdict is kept.
EVENT_NOT_APPLIED = "cdi-not-applied"
EVENT_RUNTIME = "cdi-runtime"
EVENT_AWAY = "cdi-runtime-away"
#: Journal event: the runtime socket's directory cannot be watched (the verdict then follows less).
EVENT_UNWATCHED = "cdi-unwatched"


def _unwatched(directory: str, exc: OSError) -> None:
    EventLog(log).warning(
        EVENT_UNWATCHED,
        "cdi: cannot watch %s for the runtime's socket (%s); the runtime is asked again only on reload and "
        "when kubelet starts",
        directory,
        exc.strerror or exc,
    )
