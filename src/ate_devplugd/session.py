"""One resource kept served and registered with kubelet, through kubelet restarts.

A session loops over one *round*: serve a fresh gRPC server on the resource's socket (and prove it
answers), register with the kubelet that is there (waiting for one if none is), then hold until kubelet
restarts or our socket goes; then stop the server and start the next round. Events from the
``KubeletWatch`` only wake the session; it then re-reads what it depends on (is our socket still ours?
which kubelet generation is there?), so lost or reordered events cannot leave a wrong state.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import posixpath
from collections.abc import Callable

import grpc

from ate_devplugd import endpoint
from ate_devplugd.devices import Resource
from ate_devplugd.kubelet_watch import KubeletWatch, SocketLoss
from ate_devplugd.metrics import Metrics


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


class Backoff:
    """Retry delays: milliseconds at first, doubling while failures continue, capped."""

    def __init__(self, first: float = 0.005, cap: float = 30.0) -> None:
        self._first = first
        self._cap = cap
        self._next = first

    def reset(self) -> None:
        self._next = self._first

    def next(self) -> float:
        delay = self._next
        self._next = min(self._cap, self._next * 2)
        return delay


class Session:
    """Keeps ``resource`` served on ``socket_path`` and registered; ``on_state`` hears each state change."""

    def __init__(
        self,
        resource: Resource,
        socket_path: str,
        watch: KubeletWatch,
        on_state: Callable[[], None],
        metrics: Metrics,
    ) -> None:
        self.resource = resource
        self.socket_path = socket_path
        self.state = SessionState.ABSENT
        self.detail = ""
        #: Set once the session has got as far as it can on its own (served, or waiting for something).
        self.first_attempt = asyncio.Event()
        self._watch = watch
        self._on_state = on_state
        self._metrics = metrics
        self._server: endpoint.PluginServer | None = None
        self._kick = asyncio.Event()
        #: The kubelet generation this round was served under, then the one it registered with.
        self._kubelet_generation = -1
        #: Failed Register attempts toward one kubelet generation (``_failures_generation``): each new
        #: kubelet starts again at 0, as the retry delay does, so a storm of short kubelet lives never
        #: adds up to the warning that a kubelet refusing for seconds deserves.
        self._failures = 0
        self._failures_generation = -1

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
        state = self.state.value + (f": {self.detail}" if self.detail else "")
        return f"{text}, {state}"

    def _set_state(self, state: SessionState, detail: str = "") -> None:
        if (state, detail) != (self.state, self.detail):
            self.state, self.detail = state, detail
            self._metrics.set_registered(self.name, state in (SessionState.REGISTERED, SessionState.STREAM_CLOSED))
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
        self._kubelet_generation = self._watch.generation
        try:
            await self._serve()
            await self._register()
            backoff.reset()
            await self._hold()
        except endpoint.SocketGoneError:
            self._log_socket_loss()
        except endpoint.SocketInUseError as exc:
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
        self._server = endpoint.PluginServer(self.resource, self.socket_path, self._streams_changed, self._metrics)
        await self._server.start()
        self.resource.events.debug("serving", "serving %s on %s", self.name, self.socket_path)

    async def _teardown(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            await server.stop()
            self._metrics.set_streams(self.name, 0)

    async def _register(self) -> None:
        assert self._server is not None
        delay = Backoff()
        while True:
            kubelet = self._watch.look()
            if not self._server.socket_is_ours():
                raise endpoint.SocketGoneError(self.socket_path)
            if not kubelet.present:
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
                self._register_failed(exc, kubelet.generation)
                if self._watch.generation == kubelet.generation:
                    await self._wait(delay.next())
                if self._watch.generation != kubelet.generation:
                    delay.reset()  # a new kubelet.sock: try it at once
                continue
            self._kubelet_generation = kubelet.generation
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
            return

    def _register_failed(self, exc: grpc.aio.AioRpcError, generation: int) -> None:
        # kubelet.sock refusing connections is part of every kubelet start (a killed kubelet's socket
        # stays until the new one's wipe; the new one is bound a moment before it listens), and a kubelet
        # stopping cancels the call in flight: a warning only once that lasts toward one kubelet (its
        # tenth attempt, after about 2.5 s of back-off), while an error kubelet answers with (or a
        # deadline it lets pass) is one at once.
        if generation != self._failures_generation:
            self._failures_generation, self._failures = generation, 0
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

    async def _hold(self) -> None:
        """Wait until kubelet restarts or our socket goes; then return so the next round starts."""
        assert self._server is not None
        while True:
            await self._wait()
            kubelet = self._watch.look()
            if not self._server.socket_is_ours():
                self._log_socket_loss()
                return
            if kubelet.generation != self._kubelet_generation:
                self.resource.events.info(
                    "kubelet-restart", "kubelet.sock was re-created; registering %s anew", self.name
                )
                return

    def _log_socket_loss(self) -> None:
        """Our socket is gone: kubelet removing it as it starts, or someone else."""
        if self._watch.socket_loss(self._kubelet_generation) is SocketLoss.KUBELET_RESTART:
            self.resource.events.info(
                "kubelet-restart", "kubelet restarted (it removed %s); serving %s anew", self.socket_path, self.name
            )
        else:
            self.resource.events.warning(
                "socket-removed", "%s was removed while kubelet runs; serving %s anew", self.socket_path, self.name
            )

    def _streams_changed(self, streams: int) -> None:
        """Keep STATUS true: a registration kubelet no longer watches is not working."""
        self._metrics.set_streams(self.name, streams)
        if self.state not in (SessionState.REGISTERED, SessionState.STREAM_CLOSED):
            return
        if streams:
            self._set_state(SessionState.REGISTERED)
        else:
            # kubelet ends the stream when it stops; it never reopens it by itself, so until it
            # restarts (and we register anew) it sees every unit as unhealthy.
            self.resource.events.info("stream-ended", "kubelet closed ListAndWatch for %s", self.name)
            self._set_state(SessionState.STREAM_CLOSED)
