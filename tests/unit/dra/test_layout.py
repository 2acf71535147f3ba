"""Which layout the slices get: ``sharing`` as set, or what the API server's dry-run answer allows."""

from __future__ import annotations

import pytest

from ate_devplugd.config.dra import DraConfig, Layout
from ate_devplugd.config.pools import DraResource, build_pools
from ate_devplugd.dra import layout
from ate_devplugd.dra.layout import LayoutChoice, Why

UNSET = DraConfig(node_name="node-1")
KVM = DraResource("ate.dev/kvm", "ate.dev/kvm=kvm")


class TestChoice:
    @pytest.mark.parametrize("sharing", [Layout.UNITS, Layout.SHARED])
    def test_the_setting_wins(self, sharing: Layout) -> None:
        assert layout.configured(DraConfig(node_name="n", sharing=sharing)) == LayoutChoice(sharing, Why.CONFIG)
        assert layout.configured(UNSET) is None

    def test_the_answer_decides(self) -> None:
        """The dry-run's answer holds the shared device as it would be stored: kept, shared; dropped, units."""
        (pool,) = build_pools(UNSET, [KVM])[0]
        sent = layout.trial_slice(UNSET, pool)
        assert sent["spec"]["devices"] == [
            {"name": "kvm", "attributes": {"resource": {"string": "ate.dev/kvm"}}, "allowMultipleAllocations": True}
        ]
        assert "ownerReferences" not in sent["metadata"]
        assert layout.from_answer(sent) == LayoutChoice(Layout.SHARED, Why.KEPT)
        sent["spec"]["devices"][0].pop("allowMultipleAllocations")
        assert layout.from_answer(sent) == LayoutChoice(Layout.UNITS, Why.DROPPED)

    def test_said(self) -> None:
        assert str(LayoutChoice(Layout.UNITS, Why.CONFIG)) == "units (sharing set in config)"
        assert str(LayoutChoice(Layout.SHARED, Why.KEPT)) == (
            "shared (decided: the API server keeps allowMultipleAllocations)"
        )

    def test_trial_pool_is_the_pool(self) -> None:
        """probe and doctor ask about the pool the daemon would publish."""
        (pool,) = build_pools(UNSET, [KVM], Layout.SHARED)[0]
        trial = layout.trial_pool(UNSET, "ate.dev/kvm")
        assert (trial.name, trial.devices) == (pool.name, pool.devices)


class TestPoolsInEitherLayout:
    def test_unset_sharing_builds_units_until_decided(self) -> None:
        (pool,) = build_pools(UNSET, [KVM])[0]
        assert pool.layout is Layout.UNITS and len(pool.devices) == 128
        shared = pool.laid_out(Layout.SHARED)
        assert shared.devices == ("kvm",) and shared.shared and shared.name == pool.name

    @pytest.mark.parametrize("sharing", [None, Layout.UNITS, Layout.SHARED])
    def test_a_claim_of_either_layout_is_the_pools(self, sharing: Layout | None) -> None:
        """Prepare takes a device of either layout: a restart may change the layout under allocated claims."""
        (pool,) = build_pools(DraConfig(node_name="n", sharing=sharing, devices=4), [KVM])[0]
        assert all(pool.knows(name) for name in ("kvm", "kvm-0", "kvm-3"))
        assert not any(pool.knows(name) for name in ("kvm-4", "kvm-", "vhost-0", ""))
