"""One resource kept served and registered with kubelet, through kubelet restarts.

A session loops over one *round*: serve a fresh gRPC server on the resource's socket (and prove it
answers), register with the kubelet that is there (waiting for one if none is), then hold until kubelet
restarts or our socket goes; then stop the server and start the next round. Events from the
``KubeletWatch`` only wake the session; it then re-reads what it depends on (is our socket still ours?
which kubelet.sock is there?), so lost or reordered events cannot leave a wrong state.

One Register per kubelet: kubelet answers a second one by disconnecting the newer client as soon as the
older stream ends (its ``runClient``), so a round registers again only with a kubelet.sock other than the
one its Register reached (see ``kubelet.watch``). The one exception heals that very harm: when kubelet,
still running, has ended our last ListAndWatch stream and opened none for a grace (a second), it no longer
holds the resource (every unit unhealthy, allocatable 0, no further call to us), and one more Register on
the same server gives it back: every such drop, however many come in one kubelet life, each warned of
(``reregister``, with its number) and counted, the wait before each doubling while they keep coming
(``drops.Drops`` holds the timing). A Register kubelet follows with no stream counts as a drop too.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import posixpath
from collections.abc import Callable

import grpc

from ate_devplugd.base.backoff import Backoff
from ate_devplugd.base.unixserver import SocketGoneError, SocketInUseError
from ate_devplugd.base.unixsock import FileIdentity
from ate_devplugd.deviceplugin import endpoint
from ate_devplugd.deviceplugin.drops import Drops
from ate_devplugd.deviceplugin.servicer import WITHHELD
from ate_devplugd.kubelet.watch import KubeletWatch, SocketLoss
from ate_devplugd.node.devices import Resource
from ate_devplugd.signals.metrics import Metrics


class SessionState(enum.Enum):
    """Where a session stands; the text is what STATUS shows."""

    ABSENT = "absent"
    NO_DIRECTORY = "waiting for the plugin directory"
    STARTING = "starting"
    WAITING_FOR_KUBELET = "waiting for kubelet"
    REGISTERING = "registering"
    REGISTER_FAILED = "register failed"
    REGISTERED = "registered"
    STREAM_CLOSED = "registered, but kubelet closed its ListAndWatch stream"
    SOCKET_IN_USE = "socket in use"
    CANNOT_SERVE = "cannot serve"
    ERROR = "internal error; retrying"


class Session:
    """Keeps ``resource`` served on ``socket_path`` and registered; ``on_state`` hears each state change."""

    def __init__(
        self,
        resource: Resource,
        socket_path: str,
        watch: KubeletWatch,
        on_state: Callable[[], None],
        metrics: Metrics,
        *,
        withheld: bool = False,
    ) -> None:
        self.resource = resource
        self.socket_path = socket_path
        #: Served with every unit Unhealthy (``servicer.DevicePluginServicer``): DRA mode's withheld path.
        self.withheld = withheld
        self.state = SessionState.ABSENT
        self.detail = ""
        #: Set once the session has got as far as it can on its own (served, or waiting for something).
        self.first_attempt = asyncio.Event()
        self._watch = watch
        self._on_state = on_state
        self._metrics = metrics
        self._server: endpoint.PluginServer | None = None
        self._kick = asyncio.Event()
        #: The kubelet this round has accounted for (its kubelet.sock, None for none): the one there when
        #: the round began, then the one its Register reached. Any other is a kubelet not registered with.
        self._kubelet: FileIdentity | None = None
        #: Failed Register attempts toward one kubelet (``_failures_kubelet``): each new kubelet starts
        #: again at 0, as the retry delay does, so a storm of short kubelet lives never adds up to the
        #: warning that a kubelet refusing for seconds deserves.
        self._failures = 0
        self._failures_kubelet: FileIdentity | None = None
        #: Whether kubelet watches this round's registration, and when not watching is a drop to heal.
        self._drops = Drops()

    @property
    def name(self) -> str:
        return self.resource.name

    def describe(self) -> str:
        """This resource's part of STATUS."""
        if not self.resource.seen.is_set():
            return f"absent ({self.resource.presence.reason})"
        count = self.resource.config.count
        text = f"{count if self.resource.healthy else 0}/{count} healthy"
        if not self.resource.healthy:
            text += f" ({self.resource.presence.reason})"
        elif self.resource.withheld is not None:
            text += f", withheld: {self.resource.withheld.reason.value}"
        state = self.state.value + (f": {self.detail}" if self.detail else "")
        return f"{WITHHELD}, {state}" if self.withheld else f"{text}, {state}"

    def _set_state(self, state: SessionState, detail: str = "") -> None:
        # registered: kubelet holds the registration AND watches it (what it offers comes from the stream)
        self._metrics.set_registered(self.name, state is SessionState.REGISTERED and self._drops.streams > 0)
        if (state, detail) != (self.state, self.detail):
            self.state, self.detail = state, detail
            self._on_state()

    def _wake(self) -> None:
        self._kick.set()

    async def _wait(self, timeout: float | None = None) -> None:
        # asyncio.timeout, not wait_for: Python 3.11's wait_for drops a cancel that lands in the same loop
        # turn as the kick, and the stopped session would go on registering.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._kick.wait()
        self._kick.clear()

    async def run(self) -> None:
        unsubscribe = self._watch.subscribe(posixpath.basename(self.socket_path), self._wake)
        backoff = Backoff(first=0.05)
        try:
            while True:
                if not self.resource.seen.is_set():
                    self._set_state(SessionState.ABSENT)
                    self.first_attempt.set()
                    await self.resource.seen.wait()
                if not self._watch.dir_exists():
                    self._set_state(SessionState.NO_DIRECTORY, self._watch.plugin_dir)
                    self.first_attempt.set()
                    await self._wait()
                    continue
                delay = await self._round(backoff)
                if delay:
                    await self._wait(delay)
        finally:
            unsubscribe()
            await self._teardown()

    async def _round(self, backoff: Backoff) -> float:
        """Serve, register and hold once; the delay before the next round (0 for at once)."""
        self._kubelet = self._watch.kubelet()
        self._drops = Drops()
        try:
            await self._serve()
            await self._register()
            backoff.reset()
            while await self._hold():
                await self._register()
                self._drops.expect(asyncio.get_running_loop().time())  # a stream must follow
        except SocketGoneError:
            self._log_socket_loss()
        except SocketInUseError as exc:
            self.resource.events.error("socket-in-use", "%s", exc)
            self._set_state(SessionState.SOCKET_IN_USE, str(exc))
            return backoff.next()
        except OSError as exc:
            self.resource.events.error("serve-failed", "cannot serve %s on %s: %s", self.name, self.socket_path, exc)
            self._set_state(SessionState.CANNOT_SERVE, str(exc.strerror or exc))
            return backoff.next()
        except Exception:  # noqa: BLE001 - the one supervisor boundary: log, back off, start afresh
            self.resource.events.error("session-error", "unexpected error serving %s", self.name, exc_info=True)
            self._set_state(SessionState.ERROR)
            return backoff.next()
        finally:
            self.first_attempt.set()
            await self._teardown()
        return 0.0

    async def _serve(self) -> None:
        self._set_state(SessionState.STARTING)
        self._server = endpoint.PluginServer(
            self.resource, self.socket_path, self._streams_changed, self._metrics, withheld=self.withheld
        )
        await self._server.start()
        self.resource.events.debug("serving", "serving %s on %s", self.name, self.socket_path)

    async def _teardown(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            await server.stop()
            self._metrics.set_streams(self.name, 0)
        self._drops.stopped()

    async def _register(self) -> None:
        assert self._server is not None
        delay = Backoff()
        while True:
            kubelet = self._watch.kubelet()
            if not self._server.socket_is_ours():
                raise SocketGoneError(self.socket_path)
            if kubelet is None:
                self._set_state(SessionState.WAITING_FOR_KUBELET)
                self.first_attempt.set()
                await self._wait()
                continue
            self._set_state(SessionState.REGISTERING)
            self.first_attempt.set()
            try:
                await endpoint.register(
                    self._watch.kubelet_socket, self.resource.config.socket_name, self.name, endpoint.REGISTER_TIMEOUT
                )
            except grpc.aio.AioRpcError as exc:
                self._register_failed(exc, kubelet)
                if self._watch.kubelet() == kubelet:
                    await self._wait(delay.next())
                if self._watch.kubelet() != kubelet:
                    delay.reset()  # another kubelet.sock: try it at once
                continue
            # Read after the call: the kubelet that took it (the one looked at before may have been
            # replaced by a new kubelet's socket in between; see kubelet_watch). Then our socket: if it
            # is gone, the kubelet.sock read may be a still newer kubelet's, whose wipe took it; the
            # loss is then judged against the kubelet looked at before the call.
            reached = self._watch.kubelet()
            gone = not self._server.socket_is_ours()
            if reached != kubelet and not gone:
                self.resource.events.debug(
                    "kubelet-replaced", "kubelet.sock was replaced during Register; %s is with the new one", self.name
                )
            self._kubelet = kubelet if gone else reached
            self._failures = 0
            self._metrics.registration(self.name)
            self.resource.events.info(
                "registered",
                "registered %s with kubelet (endpoint %s, %d units)",
                self.name,
                self.resource.config.socket_name,
                self.resource.config.count,
            )
            self._set_state(SessionState.REGISTERED)
            if gone:
                raise SocketGoneError(self.socket_path)
            return

    def _register_failed(self, exc: grpc.aio.AioRpcError, kubelet: FileIdentity) -> None:
        # kubelet.sock refusing connections is part of every kubelet start (a killed kubelet's socket
        # stays until the new one's wipe; the new one is bound a moment before it listens), and a kubelet
        # stopping cancels the call in flight: a warning only once that lasts toward one kubelet (its
        # tenth attempt, after about 2.5 s of back-off), while an error kubelet answers with (or a
        # deadline it lets pass) is one at once.
        if kubelet != self._failures_kubelet:
            self._failures_kubelet, self._failures = kubelet, 0
        self._failures += 1
        self._metrics.register_failure(self.name)
        transient = exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        first = self._failures == 1 and not transient
        level = logging.WARNING if first or self._failures == 10 or self._failures % 100 == 0 else logging.DEBUG
        self.resource.events.log(
            level,
            "register-failed",
            "registering %s with kubelet failed (attempt %d): %s: %s",
            self.name,
            self._failures,
            exc.code().name,
            exc.details(),
        )
        self._set_state(SessionState.REGISTER_FAILED, str(exc.details()))

    async def _hold(self) -> bool:
        """Wait until kubelet restarts or our socket goes (False: the next round starts), or until kubelet,
        still running, has dropped the resource (True: register once more on this server)."""
        assert self._server is not None
        while True:
            await self._wait(self._grace_left())
            if not self._server.socket_is_ours():
                self._log_socket_loss()
                return False
            kubelet = self._watch.kubelet()
            if kubelet is not None and kubelet != self._kubelet:
                self.resource.events.info(
                    "kubelet-restart", "kubelet.sock was re-created; registering %s anew", self.name
                )
                return False
            if self._dropped(kubelet):
                return True

    def _grace_left(self) -> float | None:
        """How long until kubelet not watching counts as the resource dropped (None: nothing to time)."""
        return self._drops.left(asyncio.get_running_loop().time())

    def _dropped(self, kubelet: FileIdentity | None) -> bool:
        """Whether the kubelet registered with, still running, has let the resource go (no stream for the
        wait since it stopped watching); if so, it is said and counted."""
        now = asyncio.get_running_loop().time()
        if not self._drops.due(now) or kubelet is None:
            return False  # kubelet.sock gone: a kubelet stopping; the next one's socket wakes the session
        if not self._watch.answers():
            self._drops.later(now)  # stopped, its socket left behind: the next kubelet's wipe replaces it
            return False
        self._drops.healed()
        self._metrics.reregistration(self.name)
        self.resource.events.warning(
            "reregister",
            "kubelet has not watched %s for %.1f s while it still runs: it no longer holds the resource; "
            "registering once more (drop %d with this kubelet; should it drop it again, the next in %.0f s)",
            self.name,
            now - self._drops.lost_at,
            self._drops.heals,
            self._drops.delay,
        )
        return True

    def _log_socket_loss(self) -> None:
        """Our socket is gone: kubelet removing it as it starts, or someone else."""
        if self._watch.socket_loss(self._kubelet) is SocketLoss.KUBELET_RESTART:
            self.resource.events.info(
                "kubelet-restart", "kubelet restarted (it removed %s); serving %s anew", self.socket_path, self.name
            )
        else:
            self.resource.events.warning(
                "socket-removed", "%s was removed while kubelet runs; serving %s anew", self.socket_path, self.name
            )

    def _streams_changed(self, streams: int) -> None:
        """Keep STATUS and ``registered`` true: a registration kubelet no longer watches is not working."""
        self._drops.streams_changed(streams, asyncio.get_running_loop().time())
        self._metrics.set_streams(self.name, streams)
        if self.state not in (SessionState.REGISTERED, SessionState.STREAM_CLOSED):
            return
        if streams:
            self._set_state(SessionState.REGISTERED)
            return
        # kubelet ends the stream when it stops; it never reopens it by itself, so until it restarts
        # (or, still running, is registered with once more) it sees every unit as unhealthy.
        self.resource.events.info("stream-ended", "kubelet closed ListAndWatch for %s", self.name)
        self._set_state(SessionState.STREAM_CLOSED)
        self._wake()
