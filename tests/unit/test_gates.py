"""The feature gates DRA mode needs, as ``switch-mode`` and ``doctor`` read them (``commands.gates``), and the
record rules ``switch-mode`` waits on (``commands.switch_daemon``)."""

from __future__ import annotations

from ate_devplugd.commands import gates
from ate_devplugd.commands.gates import Gate, Mapping
from ate_devplugd.commands.switch_daemon import Restart, unheld
from ate_devplugd.cri.endpoint import Kubelet
from ate_devplugd.reload.record import Instance, Serving
from ate_devplugd.reload.result import Outcome, Result

GATE = gates.EXTENDED_RESOURCE


def kubelet(*flags: str, config: str | None = None, path: str = "/var/lib/kubelet/config.yaml") -> Kubelet:
    return Kubelet(4242, ("/usr/bin/kubelet", *flags), path if config is not None or path else "", config)


def test_defaults_by_release() -> None:
    """Alpha and off in 1.34-1.35, beta and on from 1.36; none before 1.34; not known without a version."""
    assert gates.default(GATE, (1, 35, 3)) == Gate(GATE, False, "the default of kubelet 1.35: alpha, off by default")
    assert gates.default(GATE, (1, 34, 0)).on is False
    assert gates.default(GATE, (1, 36, 2)) == Gate(GATE, True, "the default of kubelet 1.36: beta, on by default")
    assert gates.default(GATE, (1, 33, 5)).on is False
    assert gates.default(GATE, None).on is None


def test_the_flag_over_the_config_file_key_by_key() -> None:
    """kubelet's --feature-gates (each, in order, the last word on a key wins) over its config file's
    featureGates; a key set nowhere has its release's default."""
    file = "kind: KubeletConfiguration\nfeatureGates:\n  DRAExtendedResource: true\n  DRAConsumableCapacity: true\n"
    names = (GATE, gates.CONSUMABLE_CAPACITY)
    on_file = gates.kubelet_gates(kubelet(config=file), names, (1, 35, 0))
    assert [g.on for g in on_file] == [True, True]
    assert on_file[0].source == "featureGates in /var/lib/kubelet/config.yaml"
    flagged = kubelet("--feature-gates=DRAExtendedResource=false", "--v=2", config=file)
    assert [g.on for g in gates.kubelet_gates(flagged, names, (1, 35, 0))] == [False, True]
    again = kubelet("--feature-gates", "DRAExtendedResource=false", "--feature-gates=DRAExtendedResource=true", path="")
    (found,) = gates.kubelet_gates(again, (GATE,), (1, 35, 0))
    assert found == Gate(GATE, True, "kubelet's --feature-gates")
    (found,) = gates.kubelet_gates(kubelet("--feature-gates=Other=true", path=""), (GATE,), (1, 36, 1))
    assert found.on is True and "default" in found.source


def test_an_unreadable_config_file_is_not_known() -> None:
    """A config file that cannot be read may set the gate either way: not known, unless a flag says."""
    (found,) = gates.kubelet_gates(kubelet(path="/root/config.yaml"), (GATE,), (1, 35, 0))
    assert found.on is None and "cannot be read" in found.source
    (found,) = gates.kubelet_gates(kubelet("--feature-gates=DRAExtendedResource=true", path="/x"), (GATE,), (1, 35, 0))
    assert found.on is True


def test_parse_flag_leaves_out_what_kubelet_refuses() -> None:
    assert gates.parse_flag("A=true, B=False,C=maybe,=true,D") == {"A": True, "B": False}


def device_class(name: str, resource: str | None, driver: str = "kvm.ate.dev") -> dict[str, object]:
    spec: dict[str, object] = {
        "selectors": [{"cel": {"expression": f'device.driver == "{driver}" && x == "ate.dev/kvm"'}}]
    }
    if resource is not None:
        spec["extendedResourceName"] = resource
    return {"metadata": {"name": name}, "spec": spec}


def test_what_the_stored_classes_say() -> None:
    """Mapped; stored without the field (the API server's gate); another driver's; none."""
    of = {"items": [device_class("kvm.ate.dev", "ate.dev/kvm")]}
    assert gates.mapping(of, "ate.dev/kvm", "kvm.ate.dev", "kvm.ate.dev") == (Mapping.MAPPED, "kvm.ate.dev")
    dropped = {"items": [device_class("kvm.ate.dev", None)]}
    assert gates.mapping(dropped, "ate.dev/kvm", "kvm.ate.dev", "kvm.ate.dev").mapping is Mapping.DROPPED
    other = {"items": [device_class("theirs", "ate.dev/kvm", driver="other.example.com")]}
    assert gates.mapping(other, "ate.dev/kvm", "kvm.ate.dev", "kvm.ate.dev") == (Mapping.OTHER_DRIVER, "theirs")
    assert gates.mapping({"items": []}, "ate.dev/kvm", "kvm.ate.dev", "kvm.ate.dev").mapping is Mapping.NONE


def record(*, pid: int = 10, started: float = 100.0, ready: bool = True, **serving: object) -> Instance:
    served = Serving("ate.dev/kvm", 4096, int(serving.get("healthy", 4096)), bool(serving.get("registered", True)))
    return Instance(
        pid, "0", "device-plugin", started, "", {}, {}, ready, "STATUS", (served,), Result(0, Outcome.STARTED)
    )


def test_held_by_the_records_own_word() -> None:
    assert unheld(record(), ["ate.dev/kvm"], healthy=True) is None
    assert "is starting" in str(unheld(record(ready=False), ["ate.dev/kvm"], healthy=False))
    assert "kubelet does not hold" in str(unheld(record(registered=False), ["ate.dev/kvm"], healthy=False))
    assert unheld(record(healthy=0), ["ate.dev/kvm"], healthy=False) is None
    assert "no unit of ate.dev/kvm is healthy" in str(unheld(record(healthy=0), ["ate.dev/kvm"], healthy=True))
    assert "does not serve ate.dev/vhost-net" in str(unheld(record(), ["ate.dev/vhost-net"], healthy=False))


def test_a_record_from_before_the_restart_never_counts() -> None:
    """Another pid, or (a daemon in the same process, as in the tests) a start after the restart."""
    restart = Restart(10, 200.0)
    assert not restart.after(record(pid=10, started=100.0))
    assert restart.after(record(pid=11, started=100.0))
    assert restart.after(record(pid=10, started=200.5))
    assert Restart(0, 200.0).after(record(pid=10, started=201.0))
    assert not Restart(0, 200.0).after(record(pid=10, started=199.0))
