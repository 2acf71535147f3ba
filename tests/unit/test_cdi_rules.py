"""The CDI library's rules (``cri.rules``): which spec files load, and which spec a name resolves to.

Each case is one the library's own code decides (``pkg/cdi/spec.go``, ``cache.go``; docs/cdi-runtimes.md
names the lines)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ate_devplugd.cri.rules import DeviceNode, LoadedSpec, Trouble, load, problems, qualified_names, resolve

KVM = "ate.dev/kvm=kvm"
OURS = "/etc/cdi/ate.dev-kvm.json"


def spec(kind: str = "ate.dev/kvm", *names: str, version: str = "0.3.0", **extra: Any) -> dict[str, Any]:
    node = {"path": "/dev/kvm", "type": "c", "major": 10, "minor": 232, "permissions": "rw", "fileMode": 438}
    devices = [{"name": name, "containerEdits": {"deviceNodes": [node]}} for name in names or ("kvm",)]
    return {"cdiVersion": version, "kind": kind, "devices": devices, **extra}


class TestWhichLoad:
    def test_ours_loads(self) -> None:
        assert qualified_names(spec()) == (KVM,)
        node = DeviceNode("/dev/kvm", type="c", major=10, minor=232, file_mode=0o666, permissions="rw")
        assert load(OURS, 0, json.dumps(spec())) == LoadedSpec(OURS, 0, (KVM,), nodes=((node,),))

    def test_the_nodes_each_name_gives(self) -> None:
        """A device's nodes, then the spec's own (the library applies them to every device of the spec);
        field names in any case, as Go's JSON decoding matches them; what is left out stays None."""
        raw = {
            "cdiVersion": "0.6.0",
            "kind": "other.io/kvm",
            "containerEdits": {"DeviceNodes": [{"path": "/dev/net/tun"}]},
            "devices": [
                {"name": "a", "containerEdits": {"deviceNodes": [{"Path": "/dev//kvm", "FileMode": 384, "uid": 0}]}},
                {"name": "b", "containerEdits": {"env": ["A=1"]}},
            ],
        }
        loaded = load("/etc/cdi/other.json", 1, json.dumps(raw))
        tun = DeviceNode("/dev/net/tun")
        assert loaded.nodes_of("other.io/kvm=a") == (DeviceNode("/dev/kvm", file_mode=0o600, uid=0), tun)
        assert loaded.nodes_of("other.io/kvm=b") == (tun,)
        assert loaded.nodes_of("other.io/kvm=c") == ()

    def test_yaml(self) -> None:
        text = "cdiVersion: 0.6.0\nkind: other.io/kvm\ndevices:\n- name: kvm\n  containerEdits:\n    env: [A=1]\n"
        assert load("/etc/cdi/other.yaml", 1, text).names == ("other.io/kvm=kvm",)

    @pytest.mark.parametrize(
        ("raw", "why"),
        [
            (spec(version="0.2.0"), "cdiVersion '0.2.0'"),
            (spec(version="9.9.9"), "cdiVersion '9.9.9'"),
            (spec(kind="ate.dev"), "is not vendor/class"),
            (spec(kind="ate.dev/kvm-"), "is not vendor/class"),
            (spec("ate.dev/kvm", "-kvm"), "device name '-kvm'"),
            (spec("ate.dev/kvm", "kvm", "kvm"), "multiple device 'kvm'"),
            (spec(surprise=1), "unknown field 'surprise'"),
            ({**spec(), "devices": [{"name": "kvm", "containerEdits": {}}]}, "empty containerEdits"),
            ({**spec(), "devices": [{"name": "kvm", "containerEdits": {"env": ["=x"]}}]}, "environment variable"),
            (
                {
                    **spec(),
                    "devices": [
                        {"name": "kvm", "containerEdits": {"deviceNodes": [{"path": "/dev/kvm", "permissions": "rwx"}]}}
                    ],
                },
                "invalid permissions 'rwx'",
            ),
            (
                {
                    **spec(),
                    "devices": [{"name": "kvm", "containerEdits": {"deviceNodes": [{"path": "/d", "type": "x"}]}}],
                },
                "invalid type 'x'",
            ),
            ({**spec(), "devices": []}, "no devices"),
            (None, "not an object"),
        ],
    )
    def test_refused(self, raw: Any, why: str) -> None:
        loaded = load("/etc/cdi/x.json", 0, json.dumps(raw))
        assert loaded.names == ()
        assert why in loaded.error, loaded.error

    def test_not_json(self) -> None:
        assert load("/etc/cdi/x.json", 0, "{").error.startswith("not JSON")

    def test_field_names_match_regardless_of_case(self) -> None:
        """Go's JSON decoding matches field names without case: ``CDIVersion`` is ``cdiVersion``."""
        raw = spec()
        raw["CDIVersion"] = raw.pop("cdiVersion")
        assert qualified_names(raw) == (KVM,)


def loaded(path: str, priority: int, *names: str) -> LoadedSpec:
    return LoadedSpec(path, priority, names or (KVM,))


class TestResolve:
    def test_a_later_directory_wins(self) -> None:
        assert resolve([loaded(OURS, 0), loaded("/var/run/cdi/b.json", 1)]) == {KVM: "/var/run/cdi/b.json"}

    def test_the_same_directory_drops_the_name(self) -> None:
        assert resolve([loaded("/etc/cdi/a.json", 0), loaded(OURS, 0)]) == {KVM: None}

    def test_a_conflict_stays_though_a_later_directory_defines_it(self) -> None:
        """``conflicts`` is never cleared during a refresh: the name is dropped whatever comes later."""
        specs = [loaded("/etc/cdi/a.json", 0), loaded("/etc/cdi/b.json", 0), loaded("/var/run/cdi/ours.json", 1)]
        assert resolve(specs) == {KVM: None}


class TestProblems:
    def test_none(self) -> None:
        assert problems([loaded(OURS, 0), loaded("/etc/cdi/other.json", 0, "other.io/x=kvm")], {KVM: [OURS]}) == []

    def test_same_directory_conflict(self) -> None:
        (problem,) = problems([loaded("/etc/cdi/a.json", 0), loaded(OURS, 0)], {KVM: [OURS]})
        assert (problem.path, problem.trouble, problem.name, problem.breaks) == (
            "/etc/cdi/a.json",
            Trouble.CONFLICT,
            KVM,
            True,
        )
        assert "unresolvable CDI devices" in problem.describe()
        assert problem.remedy().startswith("remove /etc/cdi/a.json, or rename it")

    def test_later_directory_replaces_ours(self) -> None:
        """The problem carries the replacing device's nodes, so the VMM's access to them can be judged."""
        node = (DeviceNode("/dev/kvm", file_mode=0o600),)
        later = LoadedSpec("/var/run/cdi/b.json", 1, (KVM,), nodes=(node,))
        (problem,) = problems([loaded(OURS, 0), later], {KVM: [OURS]})
        assert (problem.trouble, problem.breaks, problem.nodes) == (Trouble.REPLACES, True, node)
        assert "containers get its device" in problem.describe()

    def test_earlier_directory_loses_to_ours(self) -> None:
        ours = "/var/run/cdi/ate.dev-kvm.json"
        (problem,) = problems([loaded("/etc/cdi/b.json", 0), loaded(ours, 1)], {KVM: [ours]})
        assert (problem.trouble, problem.breaks) == (Trouble.SHADOWED, False)

    def test_our_directory_read_twice_is_no_conflict(self) -> None:
        """The same file under two names of one directory (``/var/run/cdi``, ``/run/cdi``): no conflict."""
        paths = ["/run/cdi/ate.dev-kvm.json", "/var/run/cdi/ate.dev-kvm.json"]
        assert problems([loaded(paths[0], 0), loaded(paths[1], 1)], {KVM: paths}) == []

    def test_ours_refused(self) -> None:
        bad = LoadedSpec(OURS, 0, error="cdiVersion '0.2.0' is not one the library loads (0.3.0 or later)")
        (problem,) = problems([bad], {KVM: [OURS]})
        assert (problem.path, problem.trouble, problem.breaks) == (OURS, Trouble.REFUSED, True)
        assert "the CDI library refuses it (cdiVersion '0.2.0'" in problem.describe()
