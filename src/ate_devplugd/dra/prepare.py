"""NodePrepareResources and NodeUnprepareResources, apart from gRPC.

Prepare GETs each claim, checks it is the one kubelet means (same uid) and allocated, and answers one
device per allocation result of this driver, with the resource's CDI device. Nothing is kept: prepare
may come again after a kubelet restart, and unprepare has nothing to undo, so both are idempotent. One
lock serialises them, as kubelet expects of a driver.

A prepare asks the API server itself, with its own client made from the credentials as their files say
now (``credentials.CredentialFiles``), whatever the slice publisher is doing: an API server that is away,
overloaded or refusing for the moment after its start (401, 403) is asked again every quarter to half a
second until PREPARE_SECONDS after kubelet's call arrived, well inside kubelet's 45 s.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ate_devplugd.base.inflight import InFlight
from ate_devplugd.base.logs import EventLog
from ate_devplugd.config.pools import Pool
from ate_devplugd.dra.apiclient import ApiClient, ApiError, ApiUnavailable, claim_path
from ate_devplugd.dra.credentials import CredentialFiles
from ate_devplugd.dra.kubeconfig import KubeconfigError
from ate_devplugd.dra.metrics import ClaimProblem, DraMetrics

log = logging.getLogger(__name__)

#: A prepare reads its claims for at most this long after kubelet's call arrived (kubelet gives a call
#: 45 s, and a call that waited for the lock has spent some of them).
PREPARE_SECONDS = 20.0
#: Between two reads of a claim while the API server is away or refusing: at random in this range.
RETRY_SECONDS = (0.25, 0.5)


def _transient(status: int) -> bool:
    """An answer that may change within seconds: 401/403 while the server starts, throttling, 5xx."""
    return status in (401, 403, 429) or status >= 500


@dataclass(frozen=True)
class ClaimRef:
    namespace: str
    uid: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class PreparedDevice:
    request_names: tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...]
    share_id: str | None = None


@dataclass(frozen=True)
class PrepareResult:
    devices: tuple[PreparedDevice, ...] = field(default=())
    error: str = ""


class ClaimError(Exception):
    """This one claim cannot be prepared; kubelet is told why and asks again later."""

    def __init__(self, problem: ClaimProblem, message: str) -> None:
        super().__init__(message)
        self.problem = problem


class Preparer:
    """Prepares claims against the current pools; ``present`` tells which resources' devices exist."""

    def __init__(
        self,
        driver: str,
        pool_list: Sequence[Pool],
        files: CredentialFiles,
        present: Mapping[str, bool],
        metrics: DraMetrics,
    ) -> None:
        self._driver = driver
        self._pools = {pool.name: pool for pool in pool_list}
        self._files = files
        self._api: ApiClient | None = None
        #: The credentials' generation ``_api`` was made with (-1: make it again).
        self._api_generation = -1
        self._present = present
        self._metrics = metrics
        self._lock = asyncio.Lock()
        #: Set (to why) when no claim may be prepared here: the driver serves unprepare only.
        self.refusal = ""
        #: The prepares and unprepares being answered: a stop answers them first (``base.inflight``).
        self.in_flight = InFlight()

    def set_cdi_id(self, resource: str, cdi_id: str) -> bool:
        """Answer ``cdi_id`` for the devices of ``resource`` from now on; whether that changed anything."""
        for name, pool in self._pools.items():
            if pool.resource == resource and pool.cdi_id != cdi_id:
                self._pools[name] = replace(pool, cdi_id=cdi_id)
                return True
        return False

    async def close(self) -> None:
        api, self._api = self._api, None
        if api is not None:
            await api.close()

    async def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, PrepareResult]:
        if self.refusal:
            for claim in claims:
                EventLog(log).warning("dra-prepare", "dra: cannot prepare claim %s: %s", claim, self.refusal)
            return {claim.uid: PrepareResult(error=f"claim {claim}: {self.refusal}") for claim in claims}
        started = time.monotonic()
        deadline = asyncio.get_running_loop().time() + PREPARE_SECONDS
        async with self._lock:
            results = await asyncio.gather(*(self._prepare_one(claim, deadline) for claim in claims))
        self._metrics.prepare_call(time.monotonic() - started)
        return {claim.uid: result for claim, result in zip(claims, results, strict=True)}

    async def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, str]:
        """Nothing was set up per claim (the CDI spec is per resource): every claim succeeds."""
        async with self._lock:
            for claim in claims:
                EventLog(log).info("dra-unprepare", "dra: unprepared claim %s (uid %s)", claim, claim.uid)
            self._metrics.claims_unprepared(len(claims))
            return {claim.uid: "" for claim in claims}

    async def _prepare_one(self, claim: ClaimRef, deadline: float) -> PrepareResult:
        try:
            devices = tuple(await self._devices(claim, deadline))
        except ClaimError as exc:
            EventLog(log).warning("dra-prepare", "dra: cannot prepare claim %s: %s", claim, exc)
            self._metrics.claim_failed(exc.problem)
            return PrepareResult(error=f"claim {claim}: {exc}")
        names = ", ".join(f"{d.pool_name}/{d.device_name}" for d in devices) or "no device of this driver"
        EventLog(log).info("dra-prepare", "dra: prepared claim %s: %s", claim, names)
        self._metrics.claim_prepared(self._pools[d.pool_name].resource for d in devices)
        return PrepareResult(devices=devices)

    async def _client(self) -> ApiClient:
        """The client for claim reads, made again when the credentials' files changed (or after a 401)."""
        api = self._api
        if api is None or self._api_generation != self._files.generation:
            old, self._api = api, None
            try:
                api = self._api = ApiClient(self._files.load(), self._metrics.api_error)
                self._api_generation = self._files.generation  # after the load: what it read is in use
            finally:
                if old is not None:
                    await old.close()
        return api

    async def _read(self, claim: ClaimRef, deadline: float) -> dict[str, Any]:
        """The claim as the API server has it; asked again while it is away or refusing, until ``deadline``."""
        last: Exception | None = None
        try:
            async with asyncio.timeout_at(deadline):
                while True:
                    try:
                        return await (await self._client()).request("GET", claim_path(claim.namespace, claim.name))
                    except KubeconfigError as exc:
                        raise ClaimError(ClaimProblem.API, f"cannot read it: {exc}") from None
                    except ApiError as exc:
                        if exc.status == 404:
                            raise ClaimError(ClaimProblem.NOT_FOUND, "not found") from None
                        if not _transient(exc.status):
                            raise ClaimError(ClaimProblem.API, f"cannot read it: {exc}") from None
                        if exc.status == 401:
                            self._api_generation = -1  # read the credentials again for the next try
                        last = exc
                    except ApiUnavailable as exc:
                        last = exc
                    delay = random.uniform(*RETRY_SECONDS)
                    log.debug("dra: cannot read claim %s yet (%s); asking again in %.2f s", claim, last, delay)
                    await asyncio.sleep(delay)  # a retry delay while the API server is away, not a poll
        except TimeoutError:
            raise ClaimError(
                ClaimProblem.API, f"cannot read it within {PREPARE_SECONDS:g} s: {last or 'no answer'}"
            ) from None

    async def _devices(self, claim: ClaimRef, deadline: float) -> list[PreparedDevice]:
        obj = await self._read(claim, deadline)
        uid = obj.get("metadata", {}).get("uid")
        if uid != claim.uid:
            raise ClaimError(
                ClaimProblem.UID_MISMATCH, f"its uid is {uid!r}, not {claim.uid!r} (deleted and created again?)"
            )
        allocation = (obj.get("status") or {}).get("allocation")
        if not allocation:
            raise ClaimError(ClaimProblem.NOT_ALLOCATED, "not allocated")
        results = (allocation.get("devices") or {}).get("results") or []
        return [self._device(result) for result in results if result.get("driver") == self._driver]

    def _device(self, result: dict[str, Any]) -> PreparedDevice:
        pool = self._pools.get(str(result.get("pool", "")))
        device = str(result.get("device", ""))
        if pool is None:
            raise ClaimError(ClaimProblem.UNKNOWN_DEVICE, f"pool {result.get('pool')!r} is not served on this node")
        if not pool.knows(device):  # in either layout: one decided at a restart may differ from the claim's
            raise ClaimError(ClaimProblem.UNKNOWN_DEVICE, f"device {device!r} is not in pool {pool.name}")
        if not self._present.get(pool.resource, False):
            raise ClaimError(ClaimProblem.DEVICE_ABSENT, f"the device of {pool.resource} is absent on this node")
        share_id = result.get("shareID")
        return PreparedDevice(
            request_names=(str(result.get("request", "")),),
            pool_name=pool.name,
            device_name=device,
            cdi_device_ids=(pool.cdi_id,),
            share_id=str(share_id) if share_id else None,
        )
