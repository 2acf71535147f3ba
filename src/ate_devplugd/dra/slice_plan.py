"""What the API server holds of this node's slices, and which writes make it what the pools say: no I/O.

``StoredSlices`` is what the API server stores of this driver's slices on this node, as a list and the
watch that follows it say, and which of the deletions the watch shows are the driver's own: the ones it
asked for, until the watch shows them. ``plan`` takes those slices, the pools as they should be
published, and the generations the driver knows of, and returns the operations, in the order the executor
(``slices.SlicePublisher``) applies them. The rules:

- Pools: a stored slice belongs to the pool its ``spec.pool.name`` names. Each pool served is one slice.
  When a pool has several (two writers, or a create whose answer was lost), the one with the highest
  generation is kept, as consumers use only a pool's highest generation, and the others are deleted
  (the lower name first among equals). A slice of a pool not served (a resource no longer configured,
  or no pool name at all) is deleted.
- Changed: a kept slice is updated when anything but its generation differs from what would be written
  (``pools.slice_matches``): the Node with its current uid as the controlling owner (a Node created
  again has a new uid), the driver, the node name, one slice in the pool, the devices (none while the
  device node is absent). Once the API server has dropped ``allowMultipleAllocations`` (its feature
  gate is off), that field is left out of the comparison: writing it again would only loop.
- Generation: every write carries a generation above any the pool had, stored or written by the
  driver, so no consumer takes an older slice for the newer.
- Why a slice is written (``PublishReason``): a pool with no slice is CREATED when the driver never
  knew one of it, and REPUBLISHED when it did and the slice is gone (kubelet's start, its 30 s grace
  for a driver that went away, a Node created again): the executor then reads the Node's uid again
  first. A changed slice is UPDATED. A kept slice that already says what would be written, in a pool
  the driver did not know yet, is adopted (a restart inside kubelet's grace): said once, not written.
- Deletions: one the driver did not ask for is someone else's (kubelet's start, its grace, the garbage
  collector): the executor says the pool is being published again, and the next plan writes it.
- Conflicts with other writers are the API server's to detect: an update sends the resourceVersion it
  read, so a slice written in between is not overwritten (409); the executor's connection fails, and
  the next one lists again and plans afresh. A delete answered 404 is done.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ate_devplugd.config import pools
from ate_devplugd.config.dra import DraConfig
from ate_devplugd.config.pools import Pool


class PublishReason(enum.Enum):
    """Why a slice was written (the ``reason`` of the slice publish counter)."""

    CREATED = "created"  # the driver knew none: the first start, or a start after kubelet expired it
    REPUBLISHED = "republished"  # it knew one, gone while it ran (kubelet's start, a new Node, an outage)
    UPDATED = "updated"  # the stored one differed: the device vanished or returned, another owner, ...


#: The node authorizer learns of a new slice from its own watch: until then it forbids get, update and
#: delete of that slice. Such a 403 is retried within this many seconds of the create.
GRAPH_LAG = 10.0


class Change(enum.Enum):
    """What a watch event changed in the stored slices."""

    STORED = "stored"  # added or modified
    DELETED_BY_DRIVER = "deleted by the driver"
    DELETED = "deleted by someone else"


class StoredSlices:
    """What the driver knows of its slices on this node: as stored, by name; their pools' generations;
    the deletions it asked for; the slices it created that the node authorizer may not know yet."""

    def __init__(self) -> None:
        self.slices: dict[str, dict[str, Any]] = {}
        #: The resourceVersion a watch starts from.
        self.resource_version = ""
        #: The highest generation of each pool seen stored or written (a pool missing: none known yet).
        self.generations: dict[str, int] = {}
        #: Slices the driver asked to delete whose deletion the watch has not shown yet.
        self._deleting: set[str] = set()
        #: When the driver created each slice (monotonic), while the node authorizer may not know it.
        self._created: dict[str, float] = {}

    def listed(self, listing: Mapping[str, Any]) -> None:
        """A fresh list; a deletion still pending is in it (not deleted yet) or done, and the watch starts after it."""
        self.slices = {obj["metadata"]["name"]: obj for obj in listing.get("items") or []}
        self.resource_version = str(listing.get("metadata", {}).get("resourceVersion", ""))
        self._deleting.clear()

    def event(self, event: Mapping[str, Any]) -> Change | None:
        """One watch event that is not an ERROR: what it changed (None for a bookmark)."""
        obj = event.get("object") or {}
        meta = obj.get("metadata", {})
        self.resource_version = str(meta.get("resourceVersion", self.resource_version))
        kind, name = event.get("type"), meta.get("name", "")
        if kind in ("ADDED", "MODIFIED"):
            self.slices[name] = obj
            return Change.STORED
        if kind != "DELETED":
            return None
        self.slices.pop(name, None)
        if name in self._deleting:
            self._deleting.discard(name)
            return Change.DELETED_BY_DRIVER
        return Change.DELETED

    def planned(self, todo: Plan) -> None:
        """A plan is carried out: the generations it saw stored are known."""
        self.generations.update(todo.generations)

    def written(self, obj: dict[str, Any], *, created_at: float | None = None) -> None:
        """The API server's answer to an update, or to a create at ``created_at`` (monotonic)."""
        name = obj["metadata"]["name"]
        self.slices[name] = obj
        pool, generation = pools.pool_of(obj)
        self.generations[pool] = max(self.generations.get(pool, 0), generation)
        if created_at is not None:
            self._created = {n: t for n, t in self._created.items() if created_at - t <= GRAPH_LAG}  # older: moot
            self._created[name] = created_at

    def authorizer_lags(self, name: str, status: int, now: float) -> bool:
        """Whether a ``status`` answer about slice ``name`` is the node authorizer's lag behind its create:
        a 403 within GRAPH_LAG of the driver's own create."""
        created = self._created.get(name)
        return status == 403 and created is not None and now - created <= GRAPH_LAG

    @property
    def recent_creates(self) -> int:
        """Creates still remembered (only those within GRAPH_LAG, at the last create)."""
        return len(self._created)

    def deleting(self, name: str) -> None:
        """The driver asks for this slice's deletion: the watch's news of it is no news."""
        self._deleting.add(name)

    def deleted(self, name: str) -> None:
        """The API server answered the deletion (or said the slice was gone)."""
        self.slices.pop(name, None)


@dataclass(frozen=True)
class Wanted:
    """What the pools should say: the facts that are not stored on the API server."""

    config: DraConfig
    pools: Sequence[Pool]
    #: Whether each resource's device node is present (its pool's slice holds its devices only then).
    present: Mapping[str, bool]
    #: The uid of this node's Node, the slices' controlling owner.
    node_uid: str
    #: The API server drops ``allowMultipleAllocations``: it is no difference worth a write.
    sharing_dropped: bool = False


@dataclass(frozen=True)
class Create:
    pool: Pool
    body: dict[str, Any]
    generation: int
    reason: PublishReason


@dataclass(frozen=True)
class Update:
    pool: Pool
    name: str
    #: The stored object with its owner and spec as they should be (its resourceVersion kept).
    body: dict[str, Any]
    generation: int
    reason: PublishReason = PublishReason.UPDATED


@dataclass(frozen=True)
class Delete:
    name: str
    #: The pool it belonged to ("" for none): for the log.
    pool_name: str


@dataclass(frozen=True)
class Adopt:
    """A stored slice kept as it is; nothing to write."""

    pool: Pool
    name: str
    devices: int


Operation = Create | Update | Delete | Adopt


@dataclass(frozen=True)
class Plan:
    """The operations, in order, and what the plan saw of the pools' generations."""

    operations: tuple[Operation, ...]
    #: The highest generation stored of each pool served that has a slice, or the one known before if higher.
    generations: dict[str, int]

    @property
    def republishes(self) -> bool:
        """Whether a slice someone else deleted is created again (the Node may be a new one)."""
        return any(isinstance(op, Create) and op.reason is PublishReason.REPUBLISHED for op in self.operations)


def sharing_dropped(pool: Pool, present: bool, stored: Mapping[str, Any]) -> bool:
    """Whether the API server dropped ``allowMultipleAllocations`` from the shared device it was sent
    (so its feature gate is off): read back from what it stored."""
    return pool.shared and present and pools.sharing_dropped(stored)


def device_count(obj: Mapping[str, Any]) -> int:
    """The devices a stored slice holds."""
    return len(obj.get("spec", {}).get("devices") or [])


def _by_pool(stored: Mapping[str, Mapping[str, Any]]) -> dict[str, list[tuple[str, Mapping[str, Any]]]]:
    """The stored slices of each pool, the one kept first: highest generation, then lowest name."""
    grouped: dict[str, list[tuple[str, Mapping[str, Any]]]] = {}
    for name in sorted(stored):
        grouped.setdefault(pools.pool_of(stored[name])[0], []).append((name, stored[name]))
    for have in grouped.values():
        have.sort(key=lambda item: -pools.pool_of(item[1])[1])  # stable: names stay in order among equals
    return grouped


def published(stored: Mapping[str, Mapping[str, Any]], pool_list: Sequence[Pool]) -> dict[str, int]:
    """Devices in the kept slice of each resource's pool (0 while it has none)."""
    grouped = _by_pool(stored)
    return {p.resource: device_count(grouped[p.name][0][1]) if p.name in grouped else 0 for p in pool_list}


def plan(stored: Mapping[str, Mapping[str, Any]], wanted: Wanted, known: Mapping[str, int]) -> Plan:
    """The operations that make ``stored`` say what ``wanted`` says (see the module doc for the rules).

    ``known`` is the highest generation of each pool the driver has seen stored or written; a pool
    missing from it is one the driver has never known a slice of."""
    config = wanted.config
    ops: list[Operation] = []
    grouped = _by_pool(stored)
    generations: dict[str, int] = {}
    for pool in wanted.pools:
        have = grouped.pop(pool.name, [])
        present = wanted.present[pool.resource]
        ops.extend(Delete(name, pool.name) for name, _ in have[1:])
        if not have:
            generation = known.get(pool.name, 0) + 1
            reason = PublishReason.REPUBLISHED if pool.name in known else PublishReason.CREATED
            body = pools.new_slice(config, pool, generation, present, wanted.node_uid)
            ops.append(Create(pool, body, generation, reason))
            continue
        name, obj = have[0]
        generations[pool.name] = max(known.get(pool.name, 0), pools.pool_of(obj)[1])
        if not pools.slice_matches(obj, config, pool, present, wanted.node_uid, ignore_sharing=wanted.sharing_dropped):
            generation = generations[pool.name] + 1
            body = dict(obj)
            body["metadata"] = {**obj["metadata"], "ownerReferences": pools.owner_refs(config, wanted.node_uid)}
            body["spec"] = pools.slice_spec(config, pool, generation, present)
            ops.append(Update(pool, name, body, generation))
        elif pool.name not in known:
            ops.append(Adopt(pool, name, device_count(obj)))
    for pool_name, stale in sorted(grouped.items()):  # pools not served
        ops.extend(Delete(name, pool_name) for name, _ in stale)
    return Plan(tuple(ops), generations)
