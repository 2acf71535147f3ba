"""Which layout the slices have: the one ``sharing`` sets, or the one the cluster can hold.

``sharing`` set in ``[dra]`` wins. Not set, the layout follows the cluster: shared (one device with
``allowMultipleAllocations``, which every claim shares) where the API server keeps that field, units
where it drops it (the DRAConsumableCapacity gate off: Kubernetes 1.34-1.35 by default, or turned off).

The question is a dry-run create (``dryRun=All``) of the slice the shared layout would publish: the API
server authorizes, admits and validates it as a create, drops the fields whose gate is off, and answers
with the object it would store, storing nothing. Kubelet's credentials may make it (a slice of their own
node), and so may the service account of ``dra-manifests``. The daemon asks once per start, before its
first write, and keeps the answer while it runs (a layout never flaps); ``probe`` and ``doctor`` ask the
same question.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ate_devplugd.base.logs import EventLog
from ate_devplugd.config import pools
from ate_devplugd.config.dra import DraConfig, Layout
from ate_devplugd.config.pools import Pool
from ate_devplugd.dra.apiclient import SLICES, ApiClient

log = logging.getLogger(__name__)


class Why(enum.Enum):
    """How the layout was chosen."""

    CONFIG = "sharing set in config"
    KEPT = "decided: the API server keeps allowMultipleAllocations"
    DROPPED = "decided: the API server drops allowMultipleAllocations (DRAConsumableCapacity off)"


@dataclass(frozen=True)
class LayoutChoice:
    layout: Layout
    why: Why

    def __str__(self) -> str:
        return f"{self.layout.value} ({self.why.value})"


def configured(config: DraConfig) -> LayoutChoice | None:
    """The layout ``sharing`` sets (None: not set, the API server is asked)."""
    return LayoutChoice(config.sharing, Why.CONFIG) if config.sharing is not None else None


def trial_pool(config: DraConfig, resource: str) -> Pool:
    """A pool of ``resource`` to ask about, where no driver's pools are at hand (``probe``, ``doctor``)."""
    return Pool(
        resource, pools.pool_name(config.node_name, resource), "", pools.device_base(resource), 1, Layout.SHARED
    )


def trial_slice(config: DraConfig, pool: Pool) -> dict[str, Any]:
    """The slice asked about: ``pool`` in the shared layout, its device present, no owner (nothing is stored)."""
    return pools.new_slice(config, pool.laid_out(Layout.SHARED), 1, True, "")


def from_answer(answer: Mapping[str, Any]) -> LayoutChoice:
    """The layout the dry-run's answer (the slice as it would be stored) allows."""
    if pools.sharing_dropped(answer):
        return LayoutChoice(Layout.UNITS, Why.DROPPED)
    return LayoutChoice(Layout.SHARED, Why.KEPT)


async def decide(client: ApiClient, config: DraConfig, pool: Pool) -> LayoutChoice:
    """The configured layout, or the one the API server's answer to a dry-run create allows (an
    ``ApiError`` or ``ApiUnavailable`` when it does not answer)."""
    chosen = configured(config)
    if chosen is not None:
        return chosen
    return from_answer(await client.request("POST", SLICES, trial_slice(config, pool), params={"dryRun": "All"}))


def say_dropped(pool: Pool) -> None:
    """What the daemon says when the API server stored a shared pool's device without
    ``allowMultipleAllocations`` (a layout set to shared in the config, on a cluster without the gate)."""
    EventLog(log, resource=pool.resource).error(
        "dra-sharing-dropped",
        "dra: the API server dropped allowMultipleAllocations from pool %s: its device is exclusive, "
        'one pod at a time; enable the %s feature gate or use sharing = "units"',
        pool.name,
        pools.CONSUMABLE_CAPACITY_GATE,
    )
