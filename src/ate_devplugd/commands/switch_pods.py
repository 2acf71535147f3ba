"""``switch-mode``'s reading of the pods bound to the node: which ask our resources, which kubelet has not
admitted yet (the settle waits for them), and which took the DRA path (the drop-in stays while one is left).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def asks(pod: dict[str, Any], resources: Sequence[str]) -> bool:
    spec = pod.get("spec") or {}
    for container in [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]:
        res = container.get("resources") or {}
        if any(name in (res.get("requests") or {}) or name in (res.get("limits") or {}) for name in resources):
            return True
    return False


def admitted(pod: dict[str, Any]) -> bool:
    """Admitted by kubelet (and its claims prepared): its sandbox is made, or it ran, or it ended."""
    st = pod.get("status") or {}
    if st.get("phase") in ("Running", "Succeeded", "Failed"):
        return True
    conditions = st.get("conditions") or []
    return any(c.get("type") == "PodReadyToStartContainers" and c.get("status") == "True" for c in conditions)


def is_dra(pod: dict[str, Any]) -> bool:
    """Sent down the DRA path: its claim made by the scheduler (the extended resource's) or its own."""
    return bool(
        (pod.get("status") or {}).get("extendedResourceClaimStatus") or (pod.get("spec") or {}).get("resourceClaims")
    )


def pods_waiting(pods: list[dict[str, Any]], resources: Sequence[str]) -> str | None:
    """The pods bound here that ask our resources and are not admitted yet (None: none)."""
    waiting = [
        f"{p['metadata'].get('namespace', '')}/{p['metadata']['name']}"
        for p in pods
        if asks(p, resources) and not admitted(p) and not p["metadata"].get("deletionTimestamp")
    ]
    return f"{len(waiting)} pod(s) not admitted yet: {', '.join(waiting[:5])}" if waiting else None


def dra_pods(pods: list[dict[str, Any]], resources: Sequence[str]) -> int:
    """How many of the pods took the DRA path for our resources (their claims need our driver to go)."""
    return sum(1 for p in pods if is_dra(p) and asks(p, resources))
