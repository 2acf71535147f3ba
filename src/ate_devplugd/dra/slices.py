"""Publish this node's ResourceSlices and keep them published.

One session = fresh credentials (the kubeconfig read again), the Node's uid (waiting on a watch while
the Node does not exist yet: ``node.py``), a list of the driver's slices on this node, then a watch
from that list's resourceVersion beside a reconciler. Kubelet deletes the slices at its start and
after a 30 s driver outage, and the garbage collector deletes them with a recreated Node: each
deletion arrives on the watch and the reconciler writes the pool again at once.

Any failure ends the session; the next one starts after a back-off (a broken kubeconfig is reported
once, then retried quietly). When the API server could not be reached (or answered 5xx while it
starts), the back-off stays at about a second, jittered, so the node is back about a second after the
API server is and a fleet does not come back in step. An answer that refuses (401, 403, 422) backs off
to 30 s, except in the first SETTLE_SECONDS after the API server answers again (after an outage, or at
the daemon's start): a server that has just started may refuse for a moment, before it has loaded its
authenticators (401) or its authorization rules (403), so those two are retried on the reconnect
schedule there, and said once as a warning if they outlast it. A 401 outside that moment means the
credentials are refused (an expired token, or one bound to a Node that was deleted or created again):
STATUS, one ``dra-credentials-refused`` warning and ``ate_devplugd_dra_credentials_refused`` say so
until a session works again. A change to the credentials' files (``credentials.CredentialFiles``) ends
a back-off, or the running session, at once: the next session uses them. The first session that works
again after failures says so once, at info.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from ate_devplugd.backoff import Backoff
from ate_devplugd.dra import kubeconfig, node, pools
from ate_devplugd.dra.apiclient import SLICES, ApiClient, ApiError, ApiUnavailable, slice_path
from ate_devplugd.dra.config import DraConfig
from ate_devplugd.dra.credentials import CredentialFiles
from ate_devplugd.dra.pools import Pool
from ate_devplugd.logs import EventLog

if TYPE_CHECKING:
    from ate_devplugd.dra.metrics import DraMetrics

log = logging.getLogger(__name__)

#: The node authorizer learns of a new slice from its own watch: until then it forbids get, update and
#: delete of that slice. Such a 403 is retried within this many seconds of the create.
GRAPH_LAG = 10.0
#: Watches are renewed this often, which also re-reads the credentials (kubelet rotates its certificate).
WATCH_SECONDS = 600
#: After a session failed for want of the API server, the next one starts at most this long later:
#: half to all of it, at random (see ``reconnect_delay``).
RECONNECT_SECONDS = 1.0
#: For this long after the API server answers again, a 401 or 403 is retried on the reconnect schedule:
#: a server that has just started answers before its authenticators and authorization rules are loaded.
SETTLE_SECONDS = 30.0
#: What to do about credentials the API server refuses (401), by their kind.
TOKEN_REMEDY = (
    "the token expired, or the Node it is bound to was deleted or created again: write a new one "
    "(README: Credentials for DRA mode)"
)
CERTIFICATE_REMEDY = "the client certificate expired or is not trusted: check kubelet's certificate rotation"


def reconnect_delay(delay: float, uniform: Callable[[float, float], float] = random.uniform) -> float:
    """The back-off ``delay`` while the API server is away: at most RECONNECT_SECONDS, and jittered."""
    return uniform(0.5, 1.0) * min(delay, RECONNECT_SECONDS)


def _unreachable(exc: ApiError | ApiUnavailable) -> bool:
    """Whether the API server was away (no answer, or a 5xx while it starts), not refusing us."""
    return isinstance(exc, ApiUnavailable) or exc.status >= 500


class PublishReason(enum.Enum):
    """Why a slice was written (the ``reason`` of the slice publish counter)."""

    CREATED = "created"  # none was there: the first start, or a start after kubelet expired it
    REPUBLISHED = "republished"  # someone else deleted it while the driver ran (kubelet's start, a new Node)
    UPDATED = "updated"  # the stored one differed: the device vanished or returned, another owner, ...


class SliceState(enum.Enum):
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
    """A file the session's credentials were read from changed: start again with it."""


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
        self._published = False
        self._wake = asyncio.Event()
        self._node_uid = ""
        self._slices: dict[str, dict[str, Any]] = {}
        self._generation: dict[str, int] = {}
        self._created: dict[str, float] = {}
        self._deleted: set[str] = set()
        self._deleting: set[str] = set()
        #: Pools whose slice was written or adopted and said so (an adoption is said once per pool).
        self._announced: set[str] = set()
        self._resource_version = ""
        self._shown: tuple[SliceState, str, tuple[int, ...], bool] = (self.state, "", (), False)
        #: When the sessions began to fail (monotonic), until one works again.
        self._failing_since: float | None = None
        #: The API server has not answered since the start or since it was last away.
        self._away = True
        #: When it answered again (monotonic), while a 401 or 403 is still taken for its start's moment.
        self._answered_at: float | None = None
        #: The generation of the credentials' files the last session read.
        self._files_generation = 0
        #: Whether the last credentials read carry a token (else a client certificate).
        self._token = False
        self._refused_said = False
        self._reported = ""

    @property
    def published_devices(self) -> int:
        """Devices in the stored slices of every pool."""
        return sum(self.published.values())

    @property
    def published(self) -> dict[str, int]:
        """Devices in the stored slice of each resource's pool (0 while it has none)."""
        by_pool = {pools.pool_of(obj)[0]: obj for obj in self._slices.values()}
        return {p.resource: _count(by_pool[p.name]) if p.name in by_pool else 0 for p in self.pools}

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
        shown = (state, detail, tuple(self.published.values()), self.sharing_dropped)
        if shown != self._shown:
            self._shown = shown
            if self._on_change is not None:
                self._on_change()

    async def run(self) -> None:
        """Sessions until cancelled, with a back-off after each failed one."""
        backoff = Backoff(*self._backoff)
        self.files.start()
        try:
            while True:
                self._published = False
                try:
                    await self._session()
                except (_Expired, node.NodeWatchExpired):
                    continue
                except _CredentialsChanged:
                    self._fresh_credentials(backoff)
                    continue
                except kubeconfig.KubeconfigError as exc:
                    message = str(exc)
                    if message != self._reported:  # one clear error per distinct problem, then quiet retries
                        EventLog(log).error("dra-kubeconfig", "dra: cannot use the kubeconfig (retrying): %s", message)
                    else:
                        log.debug("dra: kubeconfig still unusable: %s", message)
                    self._reported = message
                    self._set_state(SliceState.KUBECONFIG_ERROR, message)
                    delay = backoff.next()
                except (ApiError, ApiUnavailable) as exc:
                    if self._published:  # the session worked for a while: a fresh failure, a fresh back-off
                        backoff.reset()
                        self._reported = ""
                    delay = self._api_failed(exc, backoff.next())
                except Exception:  # the one boundary of this supervised task: log, back off, retry
                    delay = backoff.next()
                    log.exception("dra: the slice publisher failed (retrying in %.2f s)", delay)
                    self._reported = ""
                    self._set_state(SliceState.API_ERROR, "internal error (see the log)")
                if self._failing_since is None:
                    self._failing_since = time.monotonic()
                if await self._pause(delay):
                    self._fresh_credentials(backoff)
        finally:
            self.files.close()

    def _fresh_credentials(self, backoff: Backoff) -> None:
        """New credentials: tried at once, and a refusal of them is a new problem, said again."""
        backoff.reset()
        self._reported = ""
        self._refused_said = False

    async def _pause(self, delay: float) -> bool:
        """The back-off between failed sessions (not a poll); cut short, returning True, when the
        credentials' files change."""
        try:
            async with asyncio.timeout(delay):
                await self.files.changed(after=self._files_generation)
        except TimeoutError:
            return False
        return True

    def _api_failed(self, exc: ApiError | ApiUnavailable, delay: float) -> float:
        """Say why the session failed, set the state, and return how long to wait before the next one."""
        message = str(exc)
        level = logging.DEBUG if message == self._reported else logging.WARNING
        self._reported = message
        if isinstance(exc, ApiUnavailable) or _unreachable(exc):
            self._away, self._answered_at = True, None
            delay = reconnect_delay(delay)
            EventLog(log).log(level, "dra-api-error", "dra: API server: %s (retrying in %.2f s)", message, delay)
            self._set_state(SliceState.API_ERROR, message)
            return delay
        now = time.monotonic()
        if self._away:  # it answers again: a refusal now may be its start's moment
            self._away, self._answered_at = False, now
        refused = exc.status in (401, 403)
        if refused and self._answered_at is not None:
            since = now - self._answered_at
            if since < SETTLE_SECONDS:
                delay = reconnect_delay(delay)
                EventLog(log).log(
                    level,
                    "dra-api-error",
                    "dra: API server: %s, %.1f s after it answered again (it may not have loaded its "
                    "authentication or authorization yet; retrying in %.2f s)",
                    message,
                    since,
                    delay,
                )
                self._set_state(SliceState.API_ERROR, message)
                return delay
            self._answered_at = None
            if exc.status == 403:
                EventLog(log).warning(
                    "dra-api-refused",
                    "dra: the API server still refuses %.0f s after it answered again, so this is no "
                    "restart's moment: %s (backing off; retrying in %.2f s)",
                    since,
                    message,
                    delay,
                )
                self._set_state(SliceState.API_ERROR, message)
                return delay
        if exc.status == 401:
            remedy = TOKEN_REMEDY if self._token else CERTIFICATE_REMEDY
            if not self._refused_said:
                EventLog(log).warning(
                    "dra-credentials-refused",
                    "dra: the API server refuses the credentials of %s (%s): %s (retrying in %.2f s)",
                    self.config.kubeconfig,
                    message,
                    remedy,
                    delay,
                )
                self._refused_said = True
            else:
                log.debug("dra: credentials still refused: %s (retrying in %.2f s)", message, delay)
            self._set_state(SliceState.CREDENTIALS_REFUSED, f"{message}; {remedy}")
            return delay
        EventLog(log).log(level, "dra-api-error", "dra: API server: %s (retrying in %.2f s)", message, delay)
        self._set_state(SliceState.API_ERROR, message)
        return delay

    async def _session(self) -> None:
        try:
            credentials = self.files.load()
        finally:
            self._files_generation = self.files.generation  # after the load: what it read is in use
        self._token = credentials.token
        client = ApiClient(credentials, self._metrics.api_error if self._metrics is not None else None)
        tasks = [asyncio.ensure_future(self._serve(client)), asyncio.ensure_future(self._credentials_changed())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
        finally:
            try:
                for task in tasks:
                    task.cancel()
                # Their outcome is known (raised above) or moot (cancelled); only their end is awaited.
                await asyncio.gather(*tasks, return_exceptions=True)
            finally:
                await client.close()

    async def _credentials_changed(self) -> None:
        await self.files.changed(after=self._files_generation)
        raise _CredentialsChanged

    async def _serve(self, client: ApiClient) -> None:
        """The Node, the list, then the watch beside the reconciler, until one of them fails."""
        tasks: list[asyncio.Task[None]] = []
        try:
            await self._refresh_node(client)
            selector = f"spec.nodeName={self.config.node_name},spec.driver={self.config.driver}"
            listing = await client.request("GET", SLICES, params={"fieldSelector": selector})
            self._slices = {obj["metadata"]["name"]: obj for obj in listing.get("items") or []}
            self._resource_version = str(listing.get("metadata", {}).get("resourceVersion", ""))
            tasks = [
                asyncio.ensure_future(self._watch(client, selector)),
                asyncio.ensure_future(self._reconcile_forever(client)),
            ]
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _refresh_node(self, client: ApiClient) -> None:
        """The Node's uid, waiting on a watch while the Node does not exist."""
        self._node_uid = await node.node_uid(
            client, self.config.node_name, watch_seconds=WATCH_SECONDS, on_waiting=self._waiting_for_node
        )

    def _waiting_for_node(self) -> None:
        self._set_state(SliceState.WAITING_FOR_NODE, self.config.node_name)

    async def _watch(self, client: ApiClient, selector: str) -> None:
        params = {
            "fieldSelector": selector,
            "resourceVersion": self._resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(WATCH_SECONDS),
        }
        async for event in client.watch(SLICES, params):
            self._on_event(event)
        # A watch the server ended in time: renew it, with credentials read again.
        raise _Expired

    def _on_event(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        obj = event.get("object") or {}
        meta = obj.get("metadata", {})
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise _Expired
            raise ApiUnavailable(f"watch: {obj.get('code')} {obj.get('reason', '')}: {obj.get('message', '')}")
        self._resource_version = str(meta.get("resourceVersion", self._resource_version))
        state, detail = self.state, self.detail
        if kind in ("ADDED", "MODIFIED"):
            self._slices[meta["name"]] = obj
            self._wake.set()
        elif kind == "DELETED":
            self._slices.pop(meta.get("name", ""), None)
            if meta.get("name") not in self._deleting:
                self._deleted.add(pools.pool_of(obj)[0])
                state, detail = SliceState.REPUBLISHING, ""
            self._wake.set()
        self._set_state(state, detail)

    async def _reconcile_forever(self, client: ApiClient) -> None:
        while True:
            self._wake.clear()
            await self._reconcile(client)
            self._published = True
            self._away, self._answered_at, self._refused_said = False, None, False
            self._set_state(SliceState.PUBLISHED, "")
            if self._failing_since is not None:
                EventLog(log).info(
                    "dra-api-back",
                    "dra: the API server session is back after %.1f s of failed attempts; slices published",
                    time.monotonic() - self._failing_since,
                )
                self._failing_since = None
            await self._wake.wait()

    async def _reconcile(self, client: ApiClient) -> None:
        """Make the stored slices say what the pools say: create, update, delete as needed."""
        by_pool: dict[str, list[dict[str, Any]]] = {}
        for obj in list(self._slices.values()):
            by_pool.setdefault(pools.pool_of(obj)[0], []).append(obj)
        for pool in self.pools:
            have = sorted(by_pool.pop(pool.name, []), key=lambda o: -pools.pool_of(o)[1])
            present = self.present[pool.resource]
            for extra in have[1:]:
                await self._delete(client, extra)
            if not have:
                await self._create(client, pool, present)
                continue
            obj = have[0]
            self._generation[pool.name] = max(self._generation.get(pool.name, 0), pools.pool_of(obj)[1])
            if not pools.slice_matches(
                obj, self.config, pool, present, self._node_uid, ignore_sharing=self.sharing_dropped
            ):
                await self._update(client, pool, obj, present)
            elif pool.name not in self._announced:  # a restart inside kubelet's 30 s grace: kept as it is
                self._announced.add(pool.name)
                _event(
                    "dra-slice-adopted",
                    pool,
                    "dra: slice %s for pool %s is already published as it should be (%s); kept",
                    obj["metadata"]["name"],
                    pool.name,
                    pools.devices_text(_count(obj)),
                )
        for stale in by_pool.values():  # pools we no longer serve
            for obj in stale:
                await self._delete(client, obj)

    def _next_generation(self, pool: Pool) -> int:
        self._generation[pool.name] = self._generation.get(pool.name, 0) + 1
        return self._generation[pool.name]

    async def _create(self, client: ApiClient, pool: Pool, present: bool) -> None:
        republish = pool.name in self._deleted
        if republish:
            await self._refresh_node(client)  # deleted with a recreated Node? The new one has a new uid.
        body = pools.new_slice(self.config, pool, self._next_generation(pool), present, self._node_uid)
        stored = await client.request("POST", SLICES, body)
        name = stored["metadata"]["name"]
        now = time.monotonic()
        self._created = {n: t for n, t in self._created.items() if now - t <= GRAPH_LAG}  # older: moot
        self._created[name] = now
        self._slices[name] = stored
        self._deleted.discard(pool.name)
        self._check_stored(pool, stored)
        event = "dra-slice-republished" if republish else "dra-slice-published"
        what = "published again after it was deleted" if republish else "published"
        self._written(pool, PublishReason.REPUBLISHED if republish else PublishReason.CREATED)
        _event(
            event, pool, "dra: slice %s for pool %s %s (%s)", name, pool.name, what, pools.devices_text(_count(stored))
        )

    async def _update(self, client: ApiClient, pool: Pool, obj: dict[str, Any], present: bool) -> None:
        name = obj["metadata"]["name"]
        body = dict(obj)
        body["metadata"] = {**obj["metadata"], "ownerReferences": pools.owner_refs(self.config, self._node_uid)}
        body["spec"] = pools.slice_spec(self.config, pool, self._next_generation(pool), present)
        stored = await self._retry_forbidden(name, lambda: client.request("PUT", slice_path(name), body))
        self._slices[name] = stored
        self._check_stored(pool, stored)
        self._written(pool, PublishReason.UPDATED)
        _event(
            "dra-slice-published",
            pool,
            "dra: slice %s for pool %s updated (%s)",
            name,
            pool.name,
            pools.devices_text(_count(stored)),
        )

    def _written(self, pool: Pool, reason: PublishReason) -> None:
        self._announced.add(pool.name)
        if self._metrics is not None:
            self._metrics.slice_written(pool.resource, reason)

    async def _delete(self, client: ApiClient, obj: dict[str, Any]) -> None:
        name = obj["metadata"]["name"]
        self._deleting.add(name)
        try:
            await self._retry_forbidden(name, lambda: client.request("DELETE", slice_path(name)))
        except ApiError as exc:
            if exc.status != 404:
                raise
        finally:
            self._deleting.discard(name)
        self._slices.pop(name, None)
        log.info("dra: deleted slice %s (pool %s)", name, pools.pool_of(obj)[0])

    async def _retry_forbidden(self, name: str, call: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
        """``call``, retrying a 403 that follows our own create of ``name`` (the authorizer lags)."""
        backoff = Backoff(0.02, 0.5)
        while True:
            try:
                return await call()
            except ApiError as exc:
                created = self._created.get(name)
                if exc.status != 403 or created is None or time.monotonic() - created > GRAPH_LAG:
                    raise
                delay = backoff.next()
                log.debug("dra: slice %s not yet known to the node authorizer; retrying in %.2f s", name, delay)
            await asyncio.sleep(delay)  # back-off for the authorizer's graph, not a poll

    def _check_stored(self, pool: Pool, stored: dict[str, Any]) -> None:
        """Read back what the apiserver stored: a shared device it made exclusive means the gate is off."""
        if not pool.shared or not self.present[pool.resource]:
            return
        if pools.sharing_dropped(stored):
            if not self.sharing_dropped:
                EventLog(log, resource=pool.resource).error(
                    "dra-sharing-dropped",
                    "dra: the API server dropped allowMultipleAllocations from pool %s: its device is exclusive, "
                    'one pod at a time; enable the %s feature gate or use sharing = "units"',
                    pool.name,
                    pools.CONSUMABLE_CAPACITY_GATE,
                )
            self.sharing_dropped = True


def _count(obj: dict[str, Any]) -> int:
    return len(obj.get("spec", {}).get("devices") or [])


def _event(name: str, pool: Pool, msg: str, *args: object) -> None:
    EventLog(log, resource=pool.resource).info(name, msg, *args)
