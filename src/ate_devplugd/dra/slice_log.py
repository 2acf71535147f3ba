"""What the slice publisher says in the journal: each slice written, kept, deleted, and its own failure."""

from __future__ import annotations

import logging

from ate_devplugd.base.logs import EventLog
from ate_devplugd.config import pools
from ate_devplugd.dra import slice_plan

log = logging.getLogger(__name__)

#: What the journal says of each write: its event and how the slice came to be written.
SAID = {
    slice_plan.PublishReason.CREATED: ("dra-slice-published", "published"),
    slice_plan.PublishReason.REPUBLISHED: ("dra-slice-republished", "published again after it was deleted"),
    slice_plan.PublishReason.UPDATED: ("dra-slice-published", "updated"),
}
#: The events of a pool's slice (``written`` logs them by name).
EVENTS = ("dra-slice-published", "dra-slice-republished", "dra-slice-adopted")


def written(op: slice_plan.Create | slice_plan.Update, name: str, devices: int) -> None:
    """A slice the API server stored, under the name it gave it, with the devices it kept."""
    event, what = SAID[op.reason]
    text = pools.devices_text(devices)
    EventLog(log, resource=op.pool.resource).info(
        event, "dra: slice %s for pool %s %s (%s)", name, op.pool.name, what, text
    )


def adopted(op: slice_plan.Adopt) -> None:
    """A start that found its slice as it would write it (kubelet's 30 s grace): kept as it is."""
    EventLog(log, resource=op.pool.resource).info(
        "dra-slice-adopted",
        "dra: slice %s for pool %s is already published as it should be (%s); kept",
        op.name,
        op.pool.name,
        pools.devices_text(op.devices),
    )


def deleted(op: slice_plan.Delete) -> None:
    log.info("dra: deleted slice %s (pool %s)", op.name, op.pool_name)


def publisher_failed(delay: float) -> None:
    """An error the publisher did not expect (with its traceback); it connects again after ``delay``."""
    EventLog(log).error(
        "dra-publisher-failed", "dra: the slice publisher failed (retrying in %.2f s)", delay, exc_info=True
    )
