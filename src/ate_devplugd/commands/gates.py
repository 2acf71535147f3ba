"""The feature gates DRA mode needs, read where the cluster shows them (``switch-mode`` and ``doctor``).

``DRAExtendedResource`` (KEP-5004) is what turns a pod's ``ate.dev/kvm: 1`` into a claim; the shared layout
also needs ``DRAConsumableCapacity``. Both are alpha and off by default in Kubernetes 1.34-1.35, beta and on
in 1.36. Each must be on in three places, and each place shows it differently:

- kube-apiserver: with the gate off it stores a DeviceClass without ``extendedResourceName``, silently.
  So the stored classes tell: one of our driver without the field (``mapping``: ``Mapping.DROPPED``).
- kubelet: with the gate off it admits a pod the scheduler sent down the DRA path as a device-plugin pod,
  and fails it (``UnexpectedAdmissionError``). Its gates are read as kubelet reads them (``kubelet_gates``):
  the config file's ``featureGates`` (the KubeletConfiguration ``--config`` names), then each
  ``--feature-gates`` on its command line in order, key by key (the flag wins, as in kubelet); a gate set
  nowhere has the default of kubelet's version.
- kube-scheduler: with the gate off it takes no DRA path (``Insufficient ate.dev/kvm``). Nothing a node may
  read shows it; the docs say so.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping as MappingType
from collections.abc import Sequence
from typing import Any, NamedTuple

from ate_devplugd.cri.endpoint import Kubelet

EXTENDED_RESOURCE = "DRAExtendedResource"
CONSUMABLE_CAPACITY = "DRAConsumableCapacity"
#: The first release in which each gate is on by default (beta); before it, back to 1.34, it is alpha.
ON_BY_DEFAULT = {EXTENDED_RESOURCE: (1, 36), CONSUMABLE_CAPACITY: (1, 36)}
#: The first release that has the gates at all.
FIRST = (1, 34)
FLAG = "--feature-gates"


def needed(shared: bool) -> tuple[str, ...]:
    """The gates a node in DRA mode needs: the extended-resource mapping, and for the shared layout the
    consumable capacity."""
    return (EXTENDED_RESOURCE, CONSUMABLE_CAPACITY) if shared else (EXTENDED_RESOURCE,)


def version_text(version: tuple[int, ...]) -> str:
    return ".".join(str(part) for part in version[:2])


def parse_flag(value: str) -> dict[str, bool]:
    """``A=true,B=false`` as ``--feature-gates`` takes it; a pair it would refuse is left out."""
    out = {}
    for pair in value.split(","):
        key, sep, word = pair.partition("=")
        if sep and key.strip() and word.strip().lower() in ("true", "false"):
            out[key.strip()] = word.strip().lower() == "true"
    return out


def flag_values(argv: Sequence[str], name: str) -> list[str]:
    """Every value of ``--name=value`` or ``--name value`` in ``argv``, in order (pflag's forms)."""
    values = []
    args = list(argv[1:])
    for i, arg in enumerate(args):
        if arg == "--":
            break
        if arg.startswith(name + "="):
            values.append(arg[len(name) + 1 :])
        elif arg == name and i + 1 < len(args):
            values.append(args[i + 1])
    return values


def config_gates(text: str) -> dict[str, bool]:
    """``featureGates`` of a KubeletConfiguration file (YAML, or JSON); {} without one."""
    import yaml  # noqa: PLC0415 - PyYAML only where kubelet has a config file

    try:
        data = json.loads(text) if text.lstrip().startswith("{") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError):
        return {}
    gates = data.get("featureGates") if isinstance(data, dict) else None
    if not isinstance(gates, dict):
        return {}
    return {str(k): v for k, v in gates.items() if isinstance(v, bool)}


class Gate(NamedTuple):
    """One gate as one component has it: on or off, and where that was read ("" when it is not known)."""

    name: str
    on: bool | None
    source: str

    def __str__(self) -> str:
        state = "on" if self.on else "off" if self.on is False else "not known"
        return f"{self.name} {state} ({self.source})" if self.source else f"{self.name} {state}"


def default(name: str, version: tuple[int, ...] | None) -> Gate:
    """A gate set nowhere: the default of that version (not known without one)."""
    if version is None:
        return Gate(name, None, "set nowhere, and kubelet's version is not known")
    if tuple(version[:2]) < FIRST:
        return Gate(name, False, f"kubelet {version_text(version)} has no such gate")
    on = tuple(version[:2]) >= ON_BY_DEFAULT[name]
    stage = "beta, on by default" if on else "alpha, off by default"
    return Gate(name, on, f"the default of kubelet {version_text(version)}: {stage}")


def kubelet_gates(kubelet: Kubelet, names: Sequence[str], version: tuple[int, ...] | None) -> list[Gate]:
    """``names`` as this kubelet has them: its flags over its config file, else its version's default (not
    known where its config file cannot be read)."""
    found: dict[str, Gate] = {}
    if kubelet.config_path and kubelet.config_text is None:
        unread = f"kubelet's config file {kubelet.config_path} cannot be read"
        found = {name: Gate(name, None, unread) for name in names}
    elif kubelet.config_text is not None:
        for key, on in config_gates(kubelet.config_text).items():
            found[key] = Gate(key, on, f"featureGates in {kubelet.config_path}")
    for value in flag_values(kubelet.argv, FLAG):
        for key, on in parse_flag(value).items():
            found[key] = Gate(key, on, f"kubelet's {FLAG}")
    return [found.get(name) or default(name, version) for name in names]


def turn_on(gates: Sequence[Gate], kubelet: Kubelet | None) -> str:
    """How to turn ``gates`` on in kubelet (where it reads them), and that the control plane needs them too."""
    names = ",".join(f"{gate.name}=true" for gate in gates)
    where = f"featureGates in {kubelet.config_path}" if kubelet is not None and kubelet.config_path else ""
    how = f"{FLAG}={names}" + (f" or {where}" if where else "")
    return f"turn on {names} in kubelet ({how}) and restart kubelet; kube-apiserver and kube-scheduler need it too"


class Mapping(enum.Enum):
    """Whether the stored DeviceClasses map a resource to our driver's devices."""

    MAPPED = "mapped"
    #: A class of our driver and resource is stored without ``extendedResourceName``: the API server's gate.
    DROPPED = "dropped"
    #: A class names the resource but selects no device of our driver.
    OTHER_DRIVER = "other driver"
    NONE = "none"


class ClassVerdict(NamedTuple):
    mapping: Mapping
    #: The class the verdict is about ("" for NONE).
    name: str


def mapping(classes: MappingType[str, Any], resource: str, driver: str, ours: str) -> ClassVerdict:
    """What the stored DeviceClasses (a DeviceClassList) say of ``resource``: mapped by a class selecting
    ``driver``; named by one selecting another; or not named, where ``ours`` (the class ``dra-manifests``
    creates for it, or any class selecting our driver and this resource) is stored without the field."""
    dropped = ""
    other = ""
    for item in classes.get("items") or []:
        spec, name = item.get("spec") or {}, (item.get("metadata") or {}).get("name", "?")
        selects = any(driver in str(sel) for sel in spec.get("selectors") or [])
        if spec.get("extendedResourceName") == resource:
            if selects:
                return ClassVerdict(Mapping.MAPPED, name)
            other = other or name
        elif selects and not spec.get("extendedResourceName") and (name == ours or resource in str(spec)):
            dropped = dropped or name
    if other:
        return ClassVerdict(Mapping.OTHER_DRIVER, other)
    return ClassVerdict(Mapping.DROPPED, dropped) if dropped else ClassVerdict(Mapping.NONE, "")


def dropped_line(name: str, resource: str) -> str:
    """What a class stored without ``extendedResourceName`` means."""
    return (
        f"DeviceClass {name} is stored without extendedResourceName {resource}: the API server drops the field "
        f"while its {EXTENDED_RESOURCE} feature gate is off (Kubernetes 1.34-1.35: alpha, off by default)"
    )


DROPPED_REMEDY = (
    f"turn on {EXTENDED_RESOURCE}=true in kube-apiserver, kube-scheduler and kubelet (--feature-gates), "
    "then apply the DeviceClasses again: ate-devplugd dra-manifests --kubelet-credentials | kubectl apply -f -"
)
