"""Pool and device naming, slice bodies, and how the publisher reads watch events."""

from __future__ import annotations

import pytest

from ate_devplugd.config.dra import DraConfig, Layout
from ate_devplugd.config.pools import DraResource, build_pools, class_name, new_slice, pool_name, slice_matches
from ate_devplugd.dra import slices
from ate_devplugd.dra.apiclient import ApiUnavailable

CONFIG = DraConfig(node_name="node-1", devices=3)


class TestPools:
    def test_names(self) -> None:
        """Pools are <node>/<domain>/<name>; devices are DNS labels from the resource's name."""
        pools, errors = build_pools(CONFIG, [DraResource("ate.dev/vhost_net", "ate.dev/vhost-net=x")])
        assert errors == []
        assert pools[0].name == "node-1/ate.dev/vhost-net"
        assert pools[0].devices == ("vhost-net-0", "vhost-net-1", "vhost-net-2")
        assert pool_name("n", "Example.COM/KVM") == "n/example.com/kvm"
        assert class_name("ate.dev/kvm") == "kvm.ate.dev"

    def test_units_override_and_shared(self) -> None:
        """A resource's own unit count wins; shared mode has one device named after the resource."""
        pools, _ = build_pools(CONFIG, [DraResource("ate.dev/kvm", "c", units=1)])
        assert pools[0].devices == ("kvm-0",)
        shared = DraConfig(node_name="node-1", sharing=Layout.SHARED)
        pools, _ = build_pools(shared, [DraResource("ate.dev/kvm", "c", units=50)])
        assert pools[0].devices == ("kvm",) and pools[0].shared

    @pytest.mark.parametrize(
        ("resources", "expected"),
        [
            ([DraResource("ate.dev/" + "k" * 60, "c")], "longer than 64 characters"),
            ([DraResource("ate.dev/kvm", "c", units=129)], "129 devices; a slice holds 1 to 128"),
            ([DraResource("ate.dev/kvm", "c"), DraResource("ATE.dev/kvm", "c")], "is already used by 'ate.dev/kvm'"),
        ],
    )
    def test_errors(self, resources: list[DraResource], expected: str) -> None:
        """A resource DRA mode cannot publish gives one error line naming it."""
        _, errors = build_pools(CONFIG, resources)
        assert len(errors) == 1 and expected in errors[0]

    def test_match_ignores_generation_only(self) -> None:
        """A stored slice matches when all but the generation is what would be written."""
        pools, _ = build_pools(CONFIG, [DraResource("ate.dev/kvm", "c")])
        stored = new_slice(CONFIG, pools[0], 7, True, "uid-1")
        assert slice_matches(stored, CONFIG, pools[0], True, "uid-1", ignore_sharing=False)
        assert not slice_matches(stored, CONFIG, pools[0], False, "uid-1", ignore_sharing=False)
        assert not slice_matches(stored, CONFIG, pools[0], True, "uid-2", ignore_sharing=False)


class TestWatchEvents:
    def publisher(self) -> slices.SlicePublisher:
        pools, _ = build_pools(CONFIG, [DraResource("ate.dev/kvm", "c")])
        return slices.SlicePublisher(CONFIG, pools)

    def test_expired_resource_version_relists(self) -> None:
        """An ERROR 410 event ends the connection so that it lists again."""
        with pytest.raises(slices._Expired):
            self.publisher()._on_event({"type": "ERROR", "object": {"kind": "Status", "code": 410}})

    def test_other_error_is_a_failure(self) -> None:
        """Any other ERROR event is an API failure (back-off and retry)."""
        with pytest.raises(ApiUnavailable, match="500"):
            self.publisher()._on_event({"type": "ERROR", "object": {"kind": "Status", "code": 500}})

    def test_bookmark_moves_resource_version(self) -> None:
        """A bookmark only advances the resourceVersion the next watch starts from."""
        pub = self.publisher()
        pub._on_event({"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "42"}}})
        assert pub._stored.resource_version == "42" and not pub._stored.slices
