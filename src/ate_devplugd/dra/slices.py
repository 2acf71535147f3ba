"""Publish this node's ResourceSlices and keep them published: ``slice_plan``'s operations, carried out.

One connection = fresh credentials (the kubeconfig read again), the Node's uid (waiting on a watch while
the Node does not exist yet: ``node.py``), once per run the layout, where the config leaves it to the
cluster (``layout.decide``), a list of the driver's slices on this node, then a watch
from that list's resourceVersion beside a reconciler, which applies ``slice_plan.plan`` to what the list
and the watch say is stored. Kubelet deletes the slices at its start and after a 30 s driver outage,
and the garbage collector deletes them with a recreated Node: each deletion arrives on the watch and
the reconciler writes the pool again at once.

Any failure ends the connection; the next one starts after a back-off, which ``reconnect.Reconnects``
shortens while the API server is away or has just come back, and which says what failed. A change to
the credentials' files (``credentials.CredentialFiles``) ends a back-off, or the running connection, at
once: the next connection uses them. The state (``SliceState``) and the counts of published devices are
for STATUS.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

from ate_devplugd.base.backoff import Backoff
from ate_devplugd.base.logs import EventLog
from ate_devplugd.config.dra import DraConfig
from ate_devplugd.config.pools import Pool
from ate_devplugd.dra import kubeconfig, layout, node, slice_log, slice_plan
from ate_devplugd.dra.apiclient import SLICES, ApiClient, ApiError, ApiUnavailable, slice_path
from ate_devplugd.dra.credentials import CredentialFiles
from ate_devplugd.dra.metrics import DraMetrics
from ate_devplugd.dra.reconnect import Reconnects, Retry

log = logging.getLogger(__name__)

#: Watches are renewed this often, which also re-reads the credentials (kubelet rotates its certificate).
WATCH_SECONDS = 600


class SliceState(enum.Enum):
    """Where the slices stand, for STATUS=; ``detail`` says why, where there is something to say."""

    WAITING = "waiting"
    #: The Node does not exist yet (kubelet creates it at its first start); ``detail`` names it.
    WAITING_FOR_NODE = "waiting for their Node"
    PUBLISHED = "published"
    #: Someone else deleted a slice (kubelet's start, its 30 s driver grace, a recreated Node).
    REPUBLISHING = "deleted, publishing again"
    KUBECONFIG_ERROR = "kubeconfig error"
    API_ERROR = "API server error"
    #: The API server answers 401, and not in the moment after it started: ``detail`` says what to do.
    CREDENTIALS_REFUSED = "not published, the API server refuses the credentials"


class _Expired(Exception):
    """The watch's resourceVersion is too old (410): list again."""


class _CredentialsChanged(Exception):
    """A file the connection's credentials were read from changed: start again with it."""


class SlicePublisher:
    """Keeps one ResourceSlice per pool on the API server while it runs."""

    def __init__(
        self,
        config: DraConfig,
        pool_list: Sequence[Pool],
        *,
        load_credentials: Callable[[str], kubeconfig.Credentials] = kubeconfig.load,
        backoff: tuple[float, float] = (0.5, 30.0),
        on_change: Callable[[], None] | None = None,
        metrics: DraMetrics | None = None,
    ) -> None:
        self.config = config
        self.pools = list(pool_list)
        #: The credentials' files, followed; prepare reads claims with the same credentials.
        self.files = CredentialFiles(config.kubeconfig, load_credentials)
        self._backoff = backoff
        self._on_change = on_change
        self._metrics = metrics
        self.present = {pool.resource: True for pool in self.pools}
        self.state = SliceState.WAITING
        self.detail = ""
        self.sharing_dropped = False
        #: The layout: the configured one, or None until the API server has answered (``layout.decide``).
        self.layout = layout.configured(config)
        self._wake = asyncio.Event()
        #: This connection's view: the Node's uid, and the stored slices as its list and watch say.
        self._node_uid = ""
        self._stored = slice_plan.StoredSlices()
        self._shown: tuple[object, ...] = ()
        self._reconnects = Reconnects(config.kubeconfig)
        #: The last connection published the slices (a failure after that starts a fresh back-off).
        self._published = False
        #: The generation of the credentials' files the last connection read.
        self._files_generation = 0
        #: Whether the last credentials read carry a token (else a client certificate).
        self._token = False

    @property
    def published(self) -> dict[str, int]:
        """Devices in the stored slice of each resource's pool (0 while it has none)."""
        return slice_plan.published(self._stored.slices, self.pools)

    def set_present(self, resource: str, present: bool) -> None:
        """The resource's device node appeared or vanished: its pool is written again."""
        if self.present.get(resource, present) != present:
            self.present[resource] = present
            self._wake.set()

    def _set_state(self, state: SliceState, detail: str = "") -> None:
        """Record the state; tell the owner when anything it shows changed (state, detail, counts).

        Called after every change to what the owner shows, the stored slices included: what was last
        shown is only a de-duplication, and must follow each of them, deletions too."""
        self.state, self.detail = state, detail
        if self._metrics is not None:
            self._metrics.credentials_refused(state is SliceState.CREDENTIALS_REFUSED)
        shown = (state, detail, tuple(self.published.values()), self.sharing_dropped, self.layout)
        if shown != self._shown:
            self._shown = shown
            if self._on_change is not None:
                self._on_change()

    async def run(self) -> None:
        """Connections until cancelled, with a back-off after each failed one."""
        backoff = Backoff(*self._backoff)
        self.files.start()
        try:
            while True:
                self._published = False
                try:
                    await self._connection()
                except (_Expired, node.NodeWatchExpired):
                    continue
                except _CredentialsChanged:
                    backoff.reset()
                    self._reconnects.new_problem(credentials=True)
                    continue
                except kubeconfig.KubeconfigError as exc:
                    message = self._reconnects.kubeconfig_failed(exc)
                    self._set_state(SliceState.KUBECONFIG_ERROR, message)
                    retry = Retry(backoff.next(), message)
                except (ApiError, ApiUnavailable) as exc:
                    if self._published:  # the connection worked for a while: a fresh failure, a fresh back-off
                        backoff.reset()
                        self._reconnects.new_problem()
                    retry = self._reconnects.api_failed(exc, backoff.next(), token=self._token)
                    refused = SliceState.CREDENTIALS_REFUSED if retry.credentials_refused else SliceState.API_ERROR
                    self._set_state(refused, retry.detail)
                except Exception:  # noqa: BLE001 - the one boundary of this supervised task: log, back off, retry
                    retry = Retry(backoff.next(), "internal error (see the log)")
                    slice_log.publisher_failed(retry.delay)
                    self._reconnects.new_problem()
                    self._set_state(SliceState.API_ERROR, retry.detail)
                self._reconnects.failed()
                if await self._pause(retry.delay):  # new credentials: tried at once, a refusal said again
                    backoff.reset()
                    self._reconnects.new_problem(credentials=True)
        finally:
            self.files.close()

    async def _pause(self, delay: float) -> bool:
        """The back-off between failed connections (not a poll); cut short, returning True, when the
        credentials' files change."""
        try:
            async with asyncio.timeout(delay):
                await self.files.changed(after=self._files_generation)
        except TimeoutError:
            return False
        return True

    async def _connection(self) -> None:
        """One connection: its credentials read, its client, until it fails or the credentials change."""
        try:
            credentials = self.files.load()
        finally:
            self._files_generation = self.files.generation  # after the load: what it read is in use
        self._token = credentials.token
        client = ApiClient(credentials, self._metrics.api_error if self._metrics is not None else None)
        try:
            await _until_one_ends(self._serve(client), self._credentials_changed())
        finally:
            await client.close()

    async def _credentials_changed(self) -> None:
        await self.files.changed(after=self._files_generation)
        raise _CredentialsChanged

    async def _serve(self, client: ApiClient) -> None:
        """The Node, the list, then the watch beside the reconciler, until one of them fails."""
        await self._refresh_node(client)
        if self.layout is None and self.pools:
            self._decided(await layout.decide(client, self.config, self.pools[0]))
        selector = f"spec.nodeName={self.config.node_name},spec.driver={self.config.driver}"
        listing = await client.request("GET", SLICES, params={"fieldSelector": selector})
        self._stored.listed(listing)
        await _until_one_ends(self._watch(client, selector), self._reconcile_forever(client))

    def _decided(self, choice: layout.LayoutChoice) -> None:
        self.layout = choice
        self.pools = [pool.laid_out(choice.layout) for pool in self.pools]
        EventLog(log).info("dra-layout", "dra: layout %s", choice)
        if self._metrics is not None:
            self._metrics.layout_decided(choice.layout)
        self._set_state(self.state, self.detail)

    async def _refresh_node(self, client: ApiClient) -> None:
        """The Node's uid, waiting on a watch while the Node does not exist."""
        waiting = functools.partial(self._set_state, SliceState.WAITING_FOR_NODE, self.config.node_name)
        self._node_uid = await node.node_uid(
            client, self.config.node_name, watch_seconds=WATCH_SECONDS, on_waiting=waiting
        )

    async def _watch(self, client: ApiClient, selector: str) -> None:
        params = {
            "fieldSelector": selector,
            "resourceVersion": self._stored.resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(WATCH_SECONDS),
        }
        async for event in client.watch(SLICES, params):
            self._on_event(event)
        # A watch the server ended in time: renew it, with credentials read again.
        raise _Expired

    def _on_event(self, event: dict[str, Any]) -> None:
        obj = event.get("object") or {}
        if event.get("type") == "ERROR":
            if obj.get("code") == 410:
                raise _Expired
            raise ApiUnavailable(f"watch: {obj.get('code')} {obj.get('reason', '')}: {obj.get('message', '')}")
        change = self._stored.event(event)
        if change is not None:
            self._wake.set()
        if change is slice_plan.Change.DELETED:  # someone else's: kubelet's start or grace, the garbage collector
            self._set_state(SliceState.REPUBLISHING)
        else:
            self._set_state(self.state, self.detail)

    async def _reconcile_forever(self, client: ApiClient) -> None:
        while True:
            self._wake.clear()
            await self._reconcile(client)
            self._published = True
            self._set_state(SliceState.PUBLISHED, "")
            self._reconnects.worked()
            await self._wake.wait()

    def _plan(self) -> slice_plan.Plan:
        wanted = slice_plan.Wanted(self.config, self.pools, self.present, self._node_uid, self.sharing_dropped)
        return slice_plan.plan(self._stored.slices, wanted, self._stored.generations)

    async def _reconcile(self, client: ApiClient) -> None:
        """Make the stored slices say what the pools say: the plan's operations, in its order."""
        todo = self._plan()
        if todo.republishes:  # deleted with a Node created again? The new one has a new uid.
            await self._refresh_node(client)
            todo = self._plan()
        self._stored.planned(todo)
        for op in todo.operations:
            if isinstance(op, slice_plan.Delete):
                await self._delete(client, op)
            elif isinstance(op, slice_plan.Adopt):  # a restart inside kubelet's 30 s grace: kept as it is
                slice_log.adopted(op)
            else:
                await self._write(client, op)

    async def _write(self, client: ApiClient, op: slice_plan.Create | slice_plan.Update) -> None:
        if isinstance(op, slice_plan.Create):
            stored = await client.request("POST", SLICES, op.body)
            self._stored.written(stored, created_at=time.monotonic())
        else:
            stored = await self._retry_forbidden(op.name, lambda: client.request("PUT", slice_path(op.name), op.body))
            self._stored.written(stored)
        name = stored["metadata"]["name"]
        self._check_stored(op.pool, stored)
        if self._metrics is not None:
            self._metrics.slice_written(op.pool.resource, op.reason)
        slice_log.written(op, name, slice_plan.device_count(stored))

    async def _delete(self, client: ApiClient, op: slice_plan.Delete) -> None:
        self._stored.deleting(op.name)
        try:
            await self._retry_forbidden(op.name, lambda: client.request("DELETE", slice_path(op.name)))
        except ApiError as exc:
            if exc.status != 404:
                raise
        self._stored.deleted(op.name)
        slice_log.deleted(op)

    async def _retry_forbidden(self, name: str, call: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
        """``call``, retrying a 403 that follows our own create of ``name`` (the authorizer lags)."""
        backoff = Backoff(0.02, 0.5)
        while True:
            try:
                return await call()
            except ApiError as exc:
                if not self._stored.authorizer_lags(name, exc.status, time.monotonic()):
                    raise
                delay = backoff.next()
                log.debug("dra: slice %s not yet known to the node authorizer; retrying in %.2f s", name, delay)
            await asyncio.sleep(delay)  # back-off for the authorizer's graph, not a poll

    def _check_stored(self, pool: Pool, stored: dict[str, Any]) -> None:
        """Read back what the apiserver stored: a shared device it made exclusive means the gate is off."""
        if slice_plan.sharing_dropped(pool, self.present[pool.resource], stored):
            if not self.sharing_dropped:
                layout.say_dropped(pool)
            self.sharing_dropped = True


async def _until_one_ends(*coroutines: Coroutine[Any, Any, None]) -> None:
    """Run them together until one ends, raising what it raised; the others are cancelled, and awaited."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()
    finally:
        for task in tasks:
            task.cancel()
        # Their outcome is known (raised above) or moot (cancelled); only their end is awaited.
        await asyncio.gather(*tasks, return_exceptions=True)
