"""The slice plan, in process: what is stored and what is wanted, in; the writes, out (table tests)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from ate_devplugd.config.dra import DraConfig, Layout
from ate_devplugd.config.pools import DraResource, Pool, build_pools, new_slice
from ate_devplugd.dra import slice_plan
from ate_devplugd.dra.slice_plan import (
    Adopt,
    Change,
    Create,
    Delete,
    PublishReason,
    StoredSlices,
    Update,
    Wanted,
    plan,
    published,
    sharing_dropped,
)

CONFIG = DraConfig(node_name="node-1", devices=3)
SHARED = DraConfig(node_name="node-1", sharing=Layout.SHARED)
KVM, VHOST = DraResource("ate.dev/kvm", "c"), DraResource("ate.dev/vhost-net", "v")
(POOL, VHOST_POOL), _ = build_pools(CONFIG, [KVM, VHOST])
(SHARED_POOL,), _ = build_pools(SHARED, [KVM])
UID = "uid-1"


def stored(
    name: str,
    generation: int,
    *,
    pool: Pool = POOL,
    present: bool = True,
    uid: str = UID,
    config: DraConfig = CONFIG,
    edit: Any = None,
) -> dict[str, Any]:
    """A slice as the API server stores it: named, with a resourceVersion."""
    obj = new_slice(config, pool, generation, present, uid)
    del obj["metadata"]["generateName"]
    obj["metadata"].update(name=name, resourceVersion="7")
    if edit is not None:
        edit(obj)
    return obj


def wanted(*pool_list: Pool, present: bool = True, uid: str = UID, **kw: Any) -> Wanted:
    config = kw.pop("config", CONFIG)
    return Wanted(config, pool_list, {p.resource: present for p in pool_list}, uid, **kw)


def summary(op: slice_plan.Operation) -> tuple[Any, ...]:
    """An operation as a row of the table: its kind, its slice or pool, generation and reason."""
    if isinstance(op, Create):
        return ("create", op.pool.name, op.generation, op.reason)
    if isinstance(op, Update):
        return ("update", op.name, op.generation, op.reason)
    if isinstance(op, Delete):
        return ("delete", op.name, op.pool_name)
    assert isinstance(op, Adopt)
    return ("adopt", op.name, op.devices)


def by_name(*objs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objs}


def other_driver(obj: dict[str, Any]) -> None:
    obj["spec"]["driver"] = "other.example.com"


def two_slices_in_pool(obj: dict[str, Any]) -> None:
    obj["spec"]["pool"]["resourceSliceCount"] = 2


def no_pool(obj: dict[str, Any]) -> None:
    del obj["spec"]["pool"]


def foreign_owner(obj: dict[str, Any]) -> None:
    obj["metadata"]["ownerReferences"] = [{"apiVersion": "v1", "kind": "Pod", "name": "x", "uid": UID}]


KVM_POOL, VHOST_NAME = POOL.name, VHOST_POOL.name


class TestPlan:
    @pytest.mark.parametrize(
        ("slices", "want", "known", "ops", "generations"),
        [
            pytest.param({}, wanted(POOL), {}, [("create", KVM_POOL, 1, PublishReason.CREATED)], {}, id="first-start"),
            pytest.param(
                {},
                wanted(POOL),
                {KVM_POOL: 4},
                [("create", KVM_POOL, 5, PublishReason.REPUBLISHED)],
                {},
                id="deleted-by-someone-else",
            ),
            pytest.param(
                by_name(stored("a", 3)), wanted(POOL), {}, [("adopt", "a", 3)], {KVM_POOL: 3}, id="adopted-once"
            ),
            pytest.param(by_name(stored("a", 3)), wanted(POOL), {KVM_POOL: 3}, [], {KVM_POOL: 3}, id="kept-quietly"),
            pytest.param(
                by_name(stored("a", 3)),
                wanted(POOL, present=False),
                {KVM_POOL: 3},
                [("update", "a", 4, PublishReason.UPDATED)],
                {KVM_POOL: 3},
                id="device-vanished",
            ),
            pytest.param(
                by_name(stored("a", 3, present=False)),
                wanted(POOL),
                {},
                [("update", "a", 4, PublishReason.UPDATED)],
                {KVM_POOL: 3},
                id="device-back",
            ),
            pytest.param(
                by_name(stored("a", 3, uid="old-uid")),
                wanted(POOL),
                {KVM_POOL: 3},
                [("update", "a", 4, PublishReason.UPDATED)],
                {KVM_POOL: 3},
                id="node-created-again",
            ),
            pytest.param(
                by_name(stored("a", 3, edit=foreign_owner)),
                wanted(POOL),
                {},
                [("update", "a", 4, PublishReason.UPDATED)],
                {KVM_POOL: 3},
                id="not-owned-by-the-node",
            ),
            pytest.param(
                by_name(stored("a", 3, edit=other_driver)),
                wanted(POOL),
                {},
                [("update", "a", 4, PublishReason.UPDATED)],
                {KVM_POOL: 3},
                id="other-driver-field",
            ),
            pytest.param(
                by_name(stored("a", 3, edit=two_slices_in_pool)),
                wanted(POOL),
                {},
                [("update", "a", 4, PublishReason.UPDATED)],
                {KVM_POOL: 3},
                id="slice-count",
            ),
            pytest.param(
                by_name(stored("a", 2)),
                wanted(POOL, present=False),
                {KVM_POOL: 9},
                [("update", "a", 10, PublishReason.UPDATED)],
                {KVM_POOL: 9},
                id="generation-above-any-known",
            ),
            pytest.param(
                by_name(stored("a", 2), stored("b", 5), stored("c", 1)),
                wanted(POOL),
                {KVM_POOL: 5},
                [("delete", "a", KVM_POOL), ("delete", "c", KVM_POOL)],
                {KVM_POOL: 5},
                id="duplicates-highest-generation-kept",
            ),
            pytest.param(
                by_name(stored("b", 5), stored("a", 5)),
                wanted(POOL),
                {KVM_POOL: 5},
                [("delete", "b", KVM_POOL)],
                {KVM_POOL: 5},
                id="duplicates-equal-first-name-kept",
            ),
            pytest.param(
                by_name(stored("a", 2), stored("b", 5, present=False)),
                wanted(POOL),
                {KVM_POOL: 5},
                [("delete", "a", KVM_POOL), ("update", "b", 6, PublishReason.UPDATED)],
                {KVM_POOL: 5},
                id="duplicates-kept-one-updated",
            ),
            pytest.param(
                by_name(stored("a", 1), stored("v", 2, pool=VHOST_POOL)),
                wanted(POOL),
                {KVM_POOL: 1},
                [("delete", "v", VHOST_NAME)],
                {KVM_POOL: 1},
                id="pool-no-longer-served",
            ),
            pytest.param(
                by_name(stored("a", 1), stored("x", 1, edit=no_pool)),
                wanted(POOL),
                {KVM_POOL: 1},
                [("delete", "x", "")],
                {KVM_POOL: 1},
                id="slice-without-pool",
            ),
            pytest.param(
                by_name(stored("v", 1, pool=VHOST_POOL), stored("z", 1, edit=no_pool)),
                wanted(POOL, VHOST_POOL),
                {VHOST_NAME: 1},
                [("create", KVM_POOL, 1, PublishReason.CREATED), ("delete", "z", "")],
                {VHOST_NAME: 1},
                id="two-pools-in-order",
            ),
        ],
    )
    def test_operations(
        self,
        slices: dict[str, dict[str, Any]],
        want: Wanted,
        known: dict[str, int],
        ops: list[tuple[Any, ...]],
        generations: dict[str, int],
    ) -> None:
        """Each case: the operations in order, and the generations the plan saw."""
        before = copy.deepcopy(slices)
        result = plan(slices, want, known)
        assert [summary(op) for op in result.operations] == ops
        assert result.generations == generations
        assert slices == before  # pure: the stored view is not touched

    def test_create_body(self) -> None:
        """A create: a generated name, the Node as controlling owner, the devices while present, the generation."""
        (op,) = plan({}, wanted(POOL, uid="u-9"), {KVM_POOL: 2}).operations
        assert isinstance(op, Create)
        assert op.body == new_slice(CONFIG, POOL, 3, True, "u-9")
        assert op.body["metadata"]["generateName"].startswith("node-1-")

    def test_update_body_keeps_the_stored_identity(self) -> None:
        """An update sends the stored name and resourceVersion (a write in between is refused), with the
        owner and spec as they should be."""
        obj = stored("a", 3, uid="old-uid")
        obj["metadata"]["labels"] = {"kept": "yes"}
        (op,) = plan(by_name(obj), wanted(POOL, present=False), {}).operations
        assert isinstance(op, Update)
        meta = op.body["metadata"]
        assert (meta["name"], meta["resourceVersion"], meta["labels"]) == ("a", "7", {"kept": "yes"})
        assert meta["ownerReferences"][0]["uid"] == UID
        assert op.body["spec"]["pool"] == {"name": KVM_POOL, "generation": 4, "resourceSliceCount": 1}
        assert op.body["spec"]["devices"] == []
        assert obj["metadata"]["ownerReferences"][0]["uid"] == "old-uid"  # the stored object is not changed

    @pytest.mark.parametrize(("dropped", "ops"), [(False, ["update"]), (True, [])])
    def test_sharing_dropped_is_no_change(self, dropped: bool, ops: list[str]) -> None:
        """A shared device stored without allowMultipleAllocations is updated, until the API server is known
        to drop the field: then writing it again would only loop."""

        def drop(obj: dict[str, Any]) -> None:
            for device in obj["spec"]["devices"]:
                del device["allowMultipleAllocations"]

        obj = stored("a", 1, pool=SHARED_POOL, config=SHARED, edit=drop)
        result = plan(by_name(obj), wanted(SHARED_POOL, config=SHARED, sharing_dropped=dropped), {SHARED_POOL.name: 1})
        assert [summary(op)[0] for op in result.operations] == ops

    @pytest.mark.parametrize(
        ("known", "republishes"),
        [({}, False), ({KVM_POOL: 1}, True)],
    )
    def test_republishes(self, known: dict[str, int], republishes: bool) -> None:
        """A plan that creates a slice someone else deleted says so (the Node is read again first)."""
        assert plan({}, wanted(POOL), known).republishes is republishes


class TestPublished:
    def test_counts_of_the_kept_slices(self) -> None:
        """The devices of each resource's kept slice (highest generation), 0 for a pool with none."""
        slices = by_name(stored("a", 1, present=False), stored("b", 2), stored("x", 1, edit=no_pool))
        assert published(slices, [POOL, VHOST_POOL]) == {"ate.dev/kvm": 3, "ate.dev/vhost-net": 0}

    @pytest.mark.parametrize(
        ("pool", "present", "drop", "expected"),
        [
            (SHARED_POOL, True, True, True),
            (SHARED_POOL, True, False, False),
            (SHARED_POOL, False, True, False),  # no device was sent
            (POOL, True, True, False),  # not shared: the field is never sent
        ],
    )
    def test_sharing_dropped(self, pool: Pool, present: bool, drop: bool, expected: bool) -> None:
        config = SHARED if pool.shared else CONFIG
        obj = new_slice(config, pool, 1, present, UID)
        for device in obj["spec"]["devices"]:
            if drop:
                device.pop("allowMultipleAllocations", None)
        assert sharing_dropped(pool, present, obj) is expected


def event(kind: str, name: str = "", rv: str = "9", **extra: Any) -> dict[str, Any]:
    return {"type": kind, "object": {"metadata": {"name": name, "resourceVersion": rv}, **extra}}


class TestStoredSlices:
    def test_list_then_events(self) -> None:
        """The list sets the view and the version to watch from; each event moves both."""
        view = StoredSlices()
        view.listed({"metadata": {"resourceVersion": "5"}, "items": [stored("a", 1)]})
        assert (set(view.slices), view.resource_version) == ({"a"}, "5")
        assert view.event(event("ADDED", "b", "6")) is Change.STORED
        assert view.event(event("MODIFIED", "a", "7")) is Change.STORED
        assert view.event({"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "8"}}}) is None
        assert (set(view.slices), view.resource_version) == ({"a", "b"}, "8")

    @pytest.mark.parametrize(
        ("asked", "change"),
        [(True, Change.DELETED_BY_DRIVER), (False, Change.DELETED)],
    )
    def test_whose_deletion(self, asked: bool, change: Change) -> None:
        """A deletion the driver asked for is its own until the watch shows it; any other is someone else's."""
        view = StoredSlices()
        view.listed({"items": [stored("a", 1)]})
        if asked:
            view.deleting("a")
            view.deleted("a")  # the answer may come before the watch's event
        assert view.event(event("DELETED", "a")) is change
        assert "a" not in view.slices
        assert view.event(event("DELETED", "a")) is Change.DELETED  # shown once: pending no more

    def test_list_ends_pending_deletions(self) -> None:
        """A new list holds a pending deletion's slice or not; the next watch starts after it."""
        view = StoredSlices()
        view.deleting("a")
        view.listed({"items": []})
        assert view.event(event("DELETED", "a")) is Change.DELETED

    def test_generations_seen_and_written(self) -> None:
        """The pools' generations: what a plan saw stored, and each write's, the highest kept; a new list
        forgets none of them."""
        view = StoredSlices()
        view.listed({"items": [stored("a", 4)]})
        view.planned(plan(view.slices, wanted(POOL), view.generations))
        assert view.generations == {KVM_POOL: 4}
        view.written(stored("b", 1, pool=VHOST_POOL), created_at=0.0)
        view.written(stored("a", 5))
        view.listed({"items": []})
        assert view.generations == {KVM_POOL: 5, VHOST_NAME: 1}
        assert plan(view.slices, wanted(POOL), view.generations).operations[0] == Create(
            POOL, new_slice(CONFIG, POOL, 6, True, UID), 6, PublishReason.REPUBLISHED
        )

    @pytest.mark.parametrize(
        ("status", "name", "after", "lags"),
        [
            (403, "a", 1.0, True),
            (403, "a", slice_plan.GRAPH_LAG, True),
            (403, "a", slice_plan.GRAPH_LAG + 0.1, False),  # the authorizer knows it by then: a real refusal
            (404, "a", 1.0, False),
            (403, "other", 1.0, False),  # not created by the driver
        ],
    )
    def test_authorizer_lag(self, status: int, name: str, after: float, lags: bool) -> None:
        """A 403 on a slice the driver created within GRAPH_LAG is the node authorizer's lag."""
        view = StoredSlices()
        view.written(stored("a", 1), created_at=100.0)
        assert view.authorizer_lags(name, status, 100.0 + after) is lags

    def test_old_creates_forgotten(self) -> None:
        """Creates are remembered only while the authorizer may lag behind them."""
        view = StoredSlices()
        for i in range(3):
            view.written(stored(f"s{i}", 1), created_at=i * (slice_plan.GRAPH_LAG + 1))
        assert view.recent_creates == 1
        view.written(stored("t", 1), created_at=2 * (slice_plan.GRAPH_LAG + 1) + 1)
        assert view.recent_creates == 2
