"""What the API server checks in a ResourceSlice (resource.k8s.io/v1), for the fake API server.

The rules are those of the apiserver's ResourceSlice validation that a node's driver can break
(types.go and its validation, read for shared/reference/dra-contract.md §3). Where the ``kubernetes``
client is installed, the object is also decoded into its V1ResourceSlice model and encoded again: a
field the API does not have, or a required one missing, makes the two differ.
"""

from __future__ import annotations

import re
from typing import Any

try:
    from kubernetes import client as k8s_client
except ImportError:
    k8s_client = None

_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_LABEL_RE = re.compile(rf"{_LABEL}\Z")
_SUBDOMAIN = re.compile(rf"{_LABEL}(\.{_LABEL})*\Z")
_ATTRIBUTE = re.compile(r"(([a-z0-9]([-a-z0-9.]*[a-z0-9])?)/)?[A-Za-z0-9]([-A-Za-z0-9_]*[A-Za-z0-9])?\Z")
_VALUE_KINDS = ("bool", "int", "string", "version")
MAX_DEVICES = 128
FIELD_SELECTORS = ("spec.nodeName", "spec.driver", "metadata.name")


class Problem(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "reason": reason,
        "message": message,
        "code": code,
    }


def field_value(obj: dict[str, Any], name: str) -> str:
    spec = obj.get("spec", {})
    return str(
        {
            "spec.nodeName": spec.get("nodeName"),
            "spec.driver": spec.get("driver"),
            "metadata.name": obj["metadata"].get("name"),
        }[name]
        or ""
    )


def parse_selector(text: str) -> dict[str, str]:
    """``a=b,c==d`` with the field labels resourceslices support (400 for another)."""
    selector: dict[str, str] = {}
    for part in filter(None, text.split(",")):
        key, sep, value = part.partition("==") if "==" in part else part.partition("=")
        if not sep or key not in FIELD_SELECTORS:
            raise Problem(400, "BadRequest", f'"{key}" is not a known field selector')
        selector[key] = value
    return selector


def validate_slice(obj: dict[str, Any], old: dict[str, Any] | None) -> list[str]:
    errors = _rules(obj, old)
    if not errors and k8s_client is not None:
        errors = model_errors(obj, "V1ResourceSlice")
    return errors


def model_errors(obj: dict[str, Any], model: str) -> list[str]:
    """Decode ``obj`` into the client's model and encode it again; any difference is an unknown field."""
    if k8s_client is None:
        return []
    api = k8s_client.ApiClient()
    obj = {**obj, "metadata": {k: v for k, v in (obj.get("metadata") or {}).items() if k != "creationTimestamp"}}
    try:
        decoded = api._ApiClient__deserialize(obj, model)
    except (ValueError, TypeError) as exc:
        return [f"{model}: {exc}"]
    again = api.sanitize_for_serialization(decoded)
    if again != obj:
        return [f"{model}: fields the API does not know or has in another form: {_diff(obj, again)}"]
    return []


def _diff(sent: Any, known: Any, where: str = "") -> str:
    if isinstance(sent, dict) and isinstance(known, dict):
        for key in sent:
            if key not in known:
                return f"{where}.{key}"
            if sent[key] != known[key]:
                return _diff(sent[key], known[key], f"{where}.{key}")
    if isinstance(sent, list) and isinstance(known, list) and len(sent) == len(known):
        for i, (a, b) in enumerate(zip(sent, known, strict=True)):
            if a != b:
                return _diff(a, b, f"{where}[{i}]")
    return where or "."


def _rules(obj: dict[str, Any], old: dict[str, Any] | None) -> list[str]:  # noqa: PLR0912
    errors: list[str] = []
    if obj.get("apiVersion") != "resource.k8s.io/v1" or obj.get("kind") != "ResourceSlice":
        errors.append(
            f"apiVersion/kind: {obj.get('apiVersion')}/{obj.get('kind')} is not resource.k8s.io/v1 ResourceSlice"
        )
    meta = obj.get("metadata") or {}
    for ref in meta.get("ownerReferences") or []:
        missing = [k for k in ("apiVersion", "kind", "name", "uid") if not ref.get(k)]
        if missing:
            errors.append(f"metadata.ownerReferences: missing {', '.join(missing)}")
    spec = obj.get("spec") or {}
    driver = spec.get("driver", "")
    if not (isinstance(driver, str) and len(driver) <= 63 and _SUBDOMAIN.match(driver)):
        errors.append(f"spec.driver: Invalid value: {driver!r}")
    if old is not None:
        for key in ("driver", "nodeName"):
            if spec.get(key) != old["spec"].get(key):
                errors.append(f"spec.{key}: Invalid value: field is immutable")
    pool = spec.get("pool") or {}
    name = pool.get("name", "")
    if not (isinstance(name, str) and 0 < len(name) <= 253 and all(_SUBDOMAIN.match(p) for p in name.split("/"))):
        errors.append(f"spec.pool.name: Invalid value: {name!r}")
    if not isinstance(pool.get("generation"), int) or pool["generation"] < 0:
        errors.append(f"spec.pool.generation: Invalid value: {pool.get('generation')!r}")
    if not isinstance(pool.get("resourceSliceCount"), int) or pool["resourceSliceCount"] <= 0:
        errors.append(f"spec.pool.resourceSliceCount: Invalid value: {pool.get('resourceSliceCount')!r}")
    chosen = [k for k in ("nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection") if spec.get(k)]
    if len(chosen) != 1:
        errors.append(f"spec: exactly one of nodeName, nodeSelector, allNodes, perDeviceNodeSelection, not {chosen}")
    devices = spec.get("devices") or []
    if len(devices) > MAX_DEVICES:
        errors.append(f"spec.devices: Too many: {len(devices)}: must have at most {MAX_DEVICES} items")
    seen: set[str] = set()
    for i, device in enumerate(devices):
        where = f"spec.devices[{i}]"
        dname = device.get("name", "")
        if not (isinstance(dname, str) and len(dname) <= 63 and _LABEL_RE.match(dname)):
            errors.append(f"{where}.name: Invalid value: {dname!r}")
        if dname in seen:
            errors.append(f"{where}.name: Duplicate value: {dname!r}")
        seen.add(dname)
        attributes = device.get("attributes") or {}
        if len(attributes) + len(device.get("capacity") or {}) > 32:
            errors.append(f"{where}: Too many: attributes and capacities together must be at most 32")
        for key, value in attributes.items():
            if not _ATTRIBUTE.match(key):
                errors.append(f"{where}.attributes[{key}]: Invalid value: not a qualified name")
            kinds = [k for k in _VALUE_KINDS if k in value]
            if len(kinds) != 1:
                errors.append(f"{where}.attributes[{key}]: exactly one value must be given, not {kinds}")
            elif kinds == ["string"] and len(value["string"]) > 64:
                errors.append(f"{where}.attributes[{key}].string: Too long: must have at most 64 bytes")
    return errors
