"""One resource kept served and registered with kubelet, through kubelet restarts.

A session loops over one *round*: serve a fresh gRPC server on the resource's socket (and prove it
answers), register with the kubelet that is there (waiting for one if none is), then hold until kubelet
restarts or our socket goes; then stop the server and start the next round. Events from the
``KubeletWatch`` only wake the session; it then re-reads what it depends on (is our socket still ours?
which kubelet.sock is there?), so lost or reordered events cannot leave a wrong state.

One Register per kubelet: kubelet answers a second one by disconnecting the newer client as soon as the
older stream ends (its ``runClient``), so a round registers again only with a kubelet.sock other than the
one its Register reached (see ``kubelet.watch``). The one exception heals a kubelet that, still running,
no longer holds the resource (``holding``: no stream for a grace, or its own word says it does not offer
what we serve). The session then serves anew before it registers once more: the old server's stop ends
every stream kubelet still holds to us first, so that end cannot disconnect the new client (1.32-1.36
disconnect a name's current client when any of its streams ends; 1.37 refuses a Register on a socket
path whose stream it still holds). ``registered`` and STATUS follow kubelet's word where it can tell
(``offer``), else the stream alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import posixpath
from collections.abc import Callable

import grpc

from ate_devplugd.base.backoff import Backoff
from ate_devplugd.base.unixserver import SocketGoneError, SocketInUseError
from ate_devplugd.base.unixsock import FileIdentity
from ate_devplugd.deviceplugin import endpoint
from ate_devplugd.deviceplugin.holding import Holding
from ate_devplugd.deviceplugin.offer import Verdict
from ate_devplugd.deviceplugin.servicer import WITHHELD
from ate_devplugd.kubelet.watch import KubeletWatch, SocketLoss
from ate_devplugd.kubelet.word import KubeletWord, Word
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
    CONFIRMING = "registered, asking kubelet what it offers"
    NOT_OFFERED = "registered, but kubelet does not offer it"
    STREAM_CLOSED = "registered, but kubelet closed its ListAndWatch stream"
    SOCKET_IN_USE = "socket in use"
    CANNOT_SERVE = "cannot serve"
    ERROR = "internal error; retrying"


#: The states of a session that holds a registration (its Register returned, the round goes on).
HOLDING = frozenset(
    {SessionState.REGISTERED, SessionState.CONFIRMING, SessionState.NOT_OFFERED, SessionState.STREAM_CLOSED}
)


class Session:
    """Keeps ``resource`` served on ``socket_path`` and registered; ``on_state`` hears each state change;
    ``word`` is kubelet's word on what it offers (None: the stream alone tells)."""

    def __init__(
        self,
        resource: Resource,
        socket_path: str,
        watch: KubeletWatch,
        on_state: Callable[[], None],
        metrics: Metrics,
        *,
        withheld: bool = False,
        word: KubeletWord | None = None,
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
        #: Failed Register attempts toward one kubelet, and how loudly each is said.
        self._refusals = endpoint.Refusals()
        self._word = word
        #: Whether kubelet holds this round's registration (its streams, its word), and when not is a drop.
        self._holding = self._new_holding()

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
        # registered: kubelet holds the registration, watches it and (where it can tell) offers what we serve
        self._metrics.set_registered(self.name, state is SessionState.REGISTERED and self._holding.streams > 0)
        if (state, detail) != (self.state, self.detail):
            self.state, self.detail = state, detail
            self._on_state()

    def _wake(self) -> None:
        self._kick.set()

    def _new_holding(self) -> Holding:
        return Holding(self.resource, self._metrics, self._word, self._watch, self._wake, withheld=self.withheld)

    async def _wait(self, timeout: float | None = None) -> None:
        # asyncio.timeout, not wait_for: Python 3.11's wait_for drops a cancel that lands in the same loop
        # turn as the kick, and the stopped session would go on registering.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._kick.wait()
        self._kick.clear()

    async def run(self) -> None:
        unsubscribe = self._watch.subscribe(posixpath.basename(self.socket_path), self._wake)
        unhear = self._word.subscribe(self._heard) if self._word is not None else None
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
            if unhear is not None:
                unhear()
            await self._teardown()

    async def _round(self, backoff: Backoff) -> float:
        """Serve, register and hold once; the delay before the next round (0 for at once)."""
        self._kubelet = self._watch.kubelet()
        self._holding = self._new_holding()
        try:
            await self._serve()
            await self._register()
            backoff.reset()
            while await self._hold():
                # afresh: every stream kubelet still holds to us ends before the next Register reaches it
                await self._teardown()
                await self._serve()
                await self._register()
                self._holding.drops.expect(asyncio.get_running_loop().time())  # a stream must follow
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
            self.resource,
            self.socket_path,
            self._streams_changed,
            self._metrics,
            withheld=self.withheld,
            on_sent=self._list_sent,
        )
        await self._server.start()
        self.resource.events.debug("serving", "serving %s on %s", self.name, self.socket_path)

    async def _teardown(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            await server.stop()
            self._metrics.set_streams(self.name, 0)
        self._holding.drops.stopped()

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
            self._holding.registering()
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
            self._refusals.reset()
            self._holding.registered()
            self._metrics.registration(self.name)
            self.resource.events.info(
                "registered",
                "registered %s with kubelet (endpoint %s, %d units)",
                self.name,
                self.resource.config.socket_name,
                self.resource.config.count,
            )
            self._show()
            if gone:
                raise SocketGoneError(self.socket_path)
            return

    def _register_failed(self, exc: grpc.aio.AioRpcError, kubelet: FileIdentity) -> None:
        attempt, level = self._refusals.failed(kubelet, exc.code())
        self._metrics.register_failure(self.name)
        self.resource.events.log(
            level,
            "register-failed",
            "registering %s with kubelet failed (attempt %d): %s: %s",
            self.name,
            attempt,
            exc.code().name,
            exc.details(),
        )
        self._set_state(SessionState.REGISTER_FAILED, str(exc.details()))

    async def _hold(self) -> bool:
        """Wait until kubelet restarts or our socket goes (False: the next round starts), or until kubelet,
        still running, has dropped the resource (True: serve anew and register once more)."""
        assert self._server is not None
        while True:
            await self._wait(self._holding.grace_left())
            if not self._server.socket_is_ours():
                self._log_socket_loss()
                return False
            kubelet = self._watch.kubelet()
            if kubelet is not None and kubelet != self._kubelet:
                self.resource.events.info(
                    "kubelet-restart", "kubelet.sock was re-created; registering %s anew", self.name
                )
                return False
            if self._holding.taken() or self._holding.dropped(kubelet is not None):
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
        self._holding.streams_changed(streams)
        self._metrics.set_streams(self.name, streams)
        if self.state not in HOLDING:
            return
        if streams:
            self._show()
            return
        # kubelet ends the stream when it stops; it never reopens it by itself, so until it restarts
        # (or, still running, is registered with once more) it sees every unit as unhealthy.
        self.resource.events.info("stream-ended", "kubelet closed ListAndWatch for %s", self.name)
        self._set_state(SessionState.STREAM_CLOSED)
        self._wake()

    def _list_sent(self, healthy: int) -> None:
        """A device list goes out to kubelet: what kubelet offers is to be asked again after it."""
        self._holding.list_sent(healthy)
        if self.state in HOLDING and self._holding.streams:
            self._show()

    def _heard(self, word: Word) -> None:
        """kubelet's word: STATUS and ``registered`` follow it; not offering what we serve is a drop."""
        if self.state in HOLDING and self._holding.heard(word):
            self._show()

    def _show(self) -> None:
        """The registration in STATUS: kubelet's word on it (after a heal, once a word taken since has come)."""
        verdict = self._holding.offer.verdict
        if verdict is Verdict.NOT_HELD:
            self._set_state(SessionState.NOT_OFFERED, self._holding.offer.detail)
        elif self._holding.offer.confirming and self._holding.asks:
            self._set_state(SessionState.CONFIRMING)
        else:
            self._set_state(SessionState.REGISTERED)
