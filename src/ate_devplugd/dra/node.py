"""The Node the slices belong to: its uid (their owner), followed with a watch until it exists.

On a node's first boot the daemon is up before kubelet has created its Node, and a Node deleted and
created again (its slices garbage-collected with it) is missing for a moment. Rather than retrying on
a timer, the publisher lists the Node and, while it is missing, watches for it: the slices go out the
moment kubelet creates it. A node's own credentials may list and watch its own Node only, with
``fieldSelector=metadata.name=<node>`` (the node authorizer, 1.32 on); the service account's
ClusterRole grants the same.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ate_devplugd.dra.apiclient import NODES, ApiClient, ApiError, ApiUnavailable, node_path

log = logging.getLogger(__name__)


class NodeWatchExpired(Exception):
    """The watch ended or its resourceVersion is too old: look again."""


async def node_uid(
    client: ApiClient, name: str, *, watch_seconds: int, on_waiting: Callable[[], None] | None = None
) -> str:
    """The uid of Node ``name``; while it does not exist, wait for it (``on_waiting`` is told once)."""
    try:
        return _uid(await client.request("GET", node_path(name)))
    except ApiError as exc:
        if exc.status != 404:
            raise
    selector = f"metadata.name={name}"
    listing = await client.request("GET", NODES, params={"fieldSelector": selector})
    for item in listing.get("items") or []:
        return _uid(item)
    log.info("dra: Node %s does not exist yet (kubelet creates it); publishing as soon as it does", name)
    if on_waiting is not None:
        on_waiting()
    params = {
        "fieldSelector": selector,
        "resourceVersion": str(listing.get("metadata", {}).get("resourceVersion", "")),
        "timeoutSeconds": str(watch_seconds),
    }
    async for event in client.watch(NODES, params):
        obj = event.get("object") or {}
        if event.get("type") == "ERROR":
            if obj.get("code") == 410:
                raise NodeWatchExpired
            raise ApiUnavailable(f"watch of Node {name}: {obj.get('code')} {obj.get('reason', '')}")
        if event.get("type") in ("ADDED", "MODIFIED") and obj.get("metadata", {}).get("name") == name:
            log.info("dra: Node %s exists now", name)
            return _uid(obj)
    raise NodeWatchExpired


def _uid(node: dict[str, Any]) -> str:
    return str(node.get("metadata", {}).get("uid", ""))
