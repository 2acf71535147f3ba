"""What DRA mode publishes: one pool per resource, its device names, and the ResourceSlice for it.

Pure functions and values, no I/O. A pool is ``<node>/<resource>`` (``node-1/ate.dev/kvm``), served by
exactly one slice, so every change to it is one atomic write. Its devices follow its layout
(``config.Layout``): ``kvm-0`` ... ``kvm-<units-1>`` in units, one ``kvm`` that allows multiple
allocations in shared. The pool's name is the same in both, so a restart that changes the layout
updates the one slice, and a claim allocated under the layout before is still the pool's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ate_devplugd.base.toml_text import toml_value
from ate_devplugd.config.device import is_dns_subdomain
from ate_devplugd.config.dra import MAX_DEVICES, DraConfig, Layout

API_VERSION = "resource.k8s.io/v1"
#: The device attribute naming the resource; unqualified, so it lives in the driver's domain.
RESOURCE_ATTRIBUTE = "resource"
#: A string attribute's value is at most 64 characters (the apiserver's limit).
MAX_ATTRIBUTE_STRING = 64
#: The feature gate without which the apiserver silently drops ``allowMultipleAllocations``.
CONSUMABLE_CAPACITY_GATE = "DRAConsumableCapacity"


@dataclass(frozen=True)
class DraResource:
    """A resource the daemon offers through DRA: its name, the CDI device naming its node, its unit count."""

    name: str
    cdi_id: str
    units: int | None = None


@dataclass(frozen=True)
class Pool:
    """One resource's pool on this node, laid out as ``layout``: the devices it holds when the device is present."""

    resource: str
    name: str
    cdi_id: str
    #: The devices' names start with this: ``kvm`` (shared), ``kvm-0`` ... (units).
    base: str
    #: The devices of the units layout.
    units: int
    layout: Layout

    @property
    def shared(self) -> bool:
        return self.layout is Layout.SHARED

    @property
    def devices(self) -> tuple[str, ...]:
        return (self.base,) if self.shared else tuple(f"{self.base}-{i}" for i in range(self.units))

    def laid_out(self, layout: Layout) -> Pool:
        """The same pool in ``layout``."""
        return replace(self, layout=layout)

    def knows(self, device: str) -> bool:
        """Whether ``device`` is this pool's in either layout: a claim allocated before a restart that
        changed the layout is still prepared (kubelet prepares a running pod's claims again at its start)."""
        return device == self.base or device in self.laid_out(Layout.UNITS).devices


def _label(text: str) -> str:
    """``text`` as a DNS label (lowercase, ``[a-z0-9-]``, no dash at either end)."""
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")


def _subdomain(text: str) -> str:
    return ".".join(filter(None, (_label(part) for part in text.split("."))))


def device_base(resource: str) -> str:
    """Device names start with the resource's name part: ``ate.dev/kvm`` -> ``kvm``."""
    return _label(resource.rpartition("/")[2]) or "device"


def pool_name(node_name: str, resource: str) -> str:
    """``<node>/<domain>/<name>``: slash-separated DNS subdomains, as the apiserver asks of pool names."""
    domain, _, name = resource.partition("/")
    return "/".join((node_name, _subdomain(domain), _subdomain(name)))


def class_name(resource: str) -> str:
    """The DeviceClass for a resource: ``ate.dev/kvm`` -> ``kvm.ate.dev``."""
    domain, _, name = resource.partition("/")
    return _subdomain(f"{name}.{domain}")


def build_pools(
    config: DraConfig, resources: Sequence[DraResource], layout: Layout | None = None
) -> tuple[list[Pool], list[str]]:
    """The pools for ``resources`` in ``layout`` (by default the configured one, or units while the layout
    follows the cluster and is not decided yet), and one error line per resource DRA mode cannot publish.
    Where the layout is not set, the units layout's names are checked: they are the longer ones."""
    layout = layout or config.sharing or Layout.UNITS
    pools: list[Pool] = []
    errors: list[str] = []
    seen: dict[str, str] = {}
    for res in resources:
        shared = config.sharing is Layout.SHARED
        units = 1 if shared else (res.units or config.devices)
        base = device_base(res.name)
        name = pool_name(config.node_name, res.name)
        where = f"dra: resource {toml_value(res.name)}"
        if len(res.name) > MAX_ATTRIBUTE_STRING:
            errors.append(f"{where}: longer than {MAX_ATTRIBUTE_STRING} characters (a device attribute's limit)")
        elif not 1 <= units <= MAX_DEVICES:
            errors.append(f"{where}: {units} devices; a slice holds 1 to {MAX_DEVICES}")
        elif len(base) + len(str(units - 1)) + 1 > 63:
            errors.append(f"{where}: its device names would be longer than 63 characters")
        elif len(name) > 253 or not all(is_dns_subdomain(part) for part in name.split("/")):
            errors.append(
                f"{where}: pool name {toml_value(name)} is not valid (at most 253 characters of DNS subdomains)"
            )
        elif name in seen:
            errors.append(f"{where}: pool name {toml_value(name)} is already used by {toml_value(seen[name])}")
        else:
            seen[name] = res.name
            pools.append(Pool(res.name, name, res.cdi_id, base, res.units or config.devices, layout))
    return pools, errors


def devices_text(count: int) -> str:
    """``1 device``, ``128 devices``: a count of devices as the logs and STATUS say it."""
    return f"{count} device" if count == 1 else f"{count} devices"


def device_entries(pool: Pool, present: bool) -> list[dict[str, Any]]:
    """The ``spec.devices`` of the pool's slice: none while its device node is absent."""
    if not present:
        return []
    entries: list[dict[str, Any]] = []
    for name in pool.devices:
        entry: dict[str, Any] = {"name": name, "attributes": {RESOURCE_ATTRIBUTE: {"string": pool.resource}}}
        if pool.shared:
            entry["allowMultipleAllocations"] = True
        entries.append(entry)
    return entries


def slice_spec(config: DraConfig, pool: Pool, generation: int, present: bool) -> dict[str, Any]:
    return {
        "driver": config.driver,
        "nodeName": config.node_name,
        "pool": {"name": pool.name, "generation": generation, "resourceSliceCount": 1},
        "devices": device_entries(pool, present),
    }


def owner_refs(config: DraConfig, node_uid: str) -> list[dict[str, Any]]:
    """The Node as a slice's controlling owner: the garbage collector deletes the slice with it."""
    return [{"apiVersion": "v1", "kind": "Node", "name": config.node_name, "uid": node_uid, "controller": True}]


def new_slice(config: DraConfig, pool: Pool, generation: int, present: bool, node_uid: str) -> dict[str, Any]:
    """A ResourceSlice to create: a generated name, the Node as its controlling owner (none: no owner)."""
    metadata: dict[str, Any] = {"generateName": f"{config.node_name}-{config.driver}-"[:200]}
    if node_uid:
        metadata["ownerReferences"] = owner_refs(config, node_uid)
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceSlice",
        "metadata": metadata,
        "spec": slice_spec(config, pool, generation, present),
    }


def pool_of(obj: Mapping[str, Any]) -> tuple[str, int]:
    """A slice's pool name and generation (``("", 0)`` when the object has none)."""
    pool = obj.get("spec", {}).get("pool", {})
    return str(pool.get("name", "")), int(pool.get("generation", 0) or 0)


def slice_matches(
    obj: Mapping[str, Any], config: DraConfig, pool: Pool, present: bool, node_uid: str, *, ignore_sharing: bool
) -> bool:
    """Whether a stored slice already says what we would write (the generation aside)."""
    spec = obj.get("spec", {})
    owners = obj.get("metadata", {}).get("ownerReferences") or []
    if not any(o.get("kind") == "Node" and o.get("uid") == node_uid for o in owners):
        return False
    if spec.get("driver") != config.driver or spec.get("nodeName") != config.node_name:
        return False
    if spec.get("pool", {}).get("resourceSliceCount") != 1:
        return False
    want = device_entries(pool, present)
    have = spec.get("devices") or []
    if ignore_sharing:
        want = [{k: v for k, v in d.items() if k != "allowMultipleAllocations"} for d in want]
        have = [{k: v for k, v in d.items() if k != "allowMultipleAllocations"} for d in have]
    return bool(want == have)


def sharing_dropped(obj: Mapping[str, Any]) -> bool:
    """Whether a stored slice lost ``allowMultipleAllocations`` that we sent (the gate is off)."""
    devices = obj.get("spec", {}).get("devices") or []
    return any(not d.get("allowMultipleAllocations") for d in devices)
