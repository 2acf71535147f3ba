"""What the API server checks in the objects DRA mode writes or ships, for the fake API server.

ResourceSlice (resource.k8s.io/v1): the rules of the apiserver's ResourceSlice validation that a node's
driver can break (``staging/src/k8s.io/api/resource/v1/types.go`` and ``pkg/apis/resource/validation``).

Object names, per kind, as each kind's validation calls apimachinery's ``ValidateObjectMeta`` with its
own name function (read in kubernetes/kubernetes: ``staging/src/k8s.io/apimachinery/pkg/api/validation``
``objectmeta.go``, ``generic.go``, ``path/name.go``; ``pkg/apis/admissionregistration/validation``;
``pkg/apis/rbac/validation``; ``pkg/apis/resource/validation``; ``pkg/apis/core/validation``). Taken:
- ``NameIsDNSSubdomain`` (at most 253 characters, lowercase RFC 1123 labels joined by dots) for
  ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding and its ``spec.policyName``, DeviceClass
  (``ValidateClassName``), ResourceSlice and ServiceAccount (``ValidateServiceAccountName``);
- ``NameIsDNSLabel`` (at most 63 characters, one label) for Namespace, and for ``metadata.namespace``;
- RBAC's ``minimalNameRequirements`` = ``path.IsValidPathSegmentName`` for ClusterRole, Role and their
  bindings, and a binding's ``roleRef.name``: anything but ``.``, ``..`` or a name holding ``/`` or ``%``
  (so ``:`` is allowed here, and only here);
- ``generateName`` is checked with the same function as a prefix (a trailing ``-`` masked, as
  ``maskTrailingDash`` does), and the generated name (base cut to 58 characters + 5) as a name;
- a namespaced kind needs ``metadata.namespace``, a cluster-scoped one must not have it;
- a ClusterRoleBinding's ServiceAccount subject needs a namespace and a subdomain name.
Not taken: labels, annotations, finalizers and managedFields (nothing here sends them but one
``app.kubernetes.io/managed-by`` label), and the CEL of a policy (compiled by the real apiserver only).

Where the ``kubernetes`` client is installed, each object is also decoded into its model and encoded
again: a field the API does not have, or a required one missing, makes the two differ.
"""

from __future__ import annotations

import json
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
#: What apimachinery's name generator keeps of a generateName before its 5 random characters.
MAX_GENERATED_BASE = 58


def _dns_name(name: str, limit: int, pattern: re.Pattern[str], what: str) -> list[str]:
    if len(name) > limit:
        return [f"must be no more than {limit} characters"]
    if not pattern.match(name):
        return [f"a lowercase RFC 1123 {what}, and must start and end with an alphanumeric character"]
    return []


def name_is_dns_subdomain(name: str) -> list[str]:
    return _dns_name(name, 253, _SUBDOMAIN, "subdomain must consist of lower case alphanumeric characters, '-' or '.'")


def name_is_dns_label(name: str) -> list[str]:
    return _dns_name(name, 63, _LABEL_RE, "label must consist of lower case alphanumeric characters or '-'")


def name_is_path_segment(name: str) -> list[str]:
    if name in (".", ".."):
        return [f"may not be '{name}'"]
    return [f"may not contain '{bad}'" for bad in ("/", "%") if bad in name]


#: kind -> (apiVersion, the name rule of its validation, namespaced, the kubernetes client's model).
KINDS: dict[str, tuple[str, Any, bool, str]] = {
    "Namespace": ("v1", name_is_dns_label, False, "V1Namespace"),
    "ServiceAccount": ("v1", name_is_dns_subdomain, True, "V1ServiceAccount"),
    "ClusterRole": ("rbac.authorization.k8s.io/v1", name_is_path_segment, False, "V1ClusterRole"),
    "ClusterRoleBinding": ("rbac.authorization.k8s.io/v1", name_is_path_segment, False, "V1ClusterRoleBinding"),
    "ValidatingAdmissionPolicy": (
        "admissionregistration.k8s.io/v1",
        name_is_dns_subdomain,
        False,
        "V1ValidatingAdmissionPolicy",
    ),
    "ValidatingAdmissionPolicyBinding": (
        "admissionregistration.k8s.io/v1",
        name_is_dns_subdomain,
        False,
        "V1ValidatingAdmissionPolicyBinding",
    ),
    "DeviceClass": ("resource.k8s.io/v1", name_is_dns_subdomain, False, "V1DeviceClass"),
    "ResourceSlice": ("resource.k8s.io/v1", name_is_dns_subdomain, False, "V1ResourceSlice"),
}


def _invalid(where: str, value: object, messages: list[str]) -> list[str]:
    return [f"{where}: Invalid value: {json.dumps(value)}: {msg}" for msg in messages]


def generated_name(generate_name: str, suffix: str) -> str:
    """The name the apiserver makes of a generateName (``suffix``: its 5 random characters)."""
    return generate_name[:MAX_GENERATED_BASE] + suffix


def validate_meta(kind: str, obj: dict[str, Any]) -> list[str]:
    """``ValidateObjectMeta`` with ``kind``'s name rule (the name already generated, if it was)."""
    if kind not in KINDS:
        return [f"kind: {kind!r} is not served here"]
    api_version, rule, namespaced, _ = KINDS[kind]
    errors: list[str] = []
    if obj.get("apiVersion") != api_version:
        errors.append(f"apiVersion: {obj.get('apiVersion')!r} is not {api_version} for {kind}")
    meta = obj.get("metadata") or {}
    generate = meta.get("generateName") or ""
    if generate:
        masked = generate[:-2] + "a" if generate.endswith("-") else generate  # maskTrailingDash, as it is
        errors += _invalid("metadata.generateName", generate, rule(masked))
    name = meta.get("name") or ""
    if not name:
        errors.append("metadata.name: Required value: name or generateName is required")
    else:
        errors += _invalid("metadata.name", name, rule(name))
    namespace = meta.get("namespace") or ""
    if namespaced and not namespace:
        errors.append("metadata.namespace: Required value")
    elif namespaced:
        errors += _invalid("metadata.namespace", namespace, name_is_dns_label(namespace))
    elif namespace:
        errors.append("metadata.namespace: Forbidden: not allowed on this type")
    return errors


def validate_spec(kind: str, obj: dict[str, Any]) -> list[str]:
    """The name references in a kind's spec that the apiserver checks."""
    errors: list[str] = []
    if kind == "ValidatingAdmissionPolicyBinding":
        policy = (obj.get("spec") or {}).get("policyName") or ""
        if not policy:
            errors.append("spec.policyName: Required value")
        else:
            errors += _invalid("spec.policyName", policy, name_is_dns_subdomain(policy))
    if kind == "ClusterRoleBinding":
        ref = obj.get("roleRef") or {}
        if ref.get("apiGroup") != "rbac.authorization.k8s.io":
            errors.append(f"roleRef.apiGroup: Unsupported value: {ref.get('apiGroup')!r}")
        if ref.get("kind") != "ClusterRole":
            errors.append(f"roleRef.kind: Unsupported value: {ref.get('kind')!r}")
        if not ref.get("name"):
            errors.append("roleRef.name: Required value")
        else:
            errors += _invalid("roleRef.name", ref["name"], name_is_path_segment(ref["name"]))
        for i, subject in enumerate(obj.get("subjects") or []):
            if subject.get("kind") != "ServiceAccount":
                continue
            where = f"subjects[{i}]"
            errors += _invalid(f"{where}.name", subject.get("name", ""), name_is_dns_subdomain(subject.get("name", "")))
            if not subject.get("namespace"):
                errors.append(f"{where}.namespace: Required value")
    return errors


def validate_object(kind: str, obj: dict[str, Any]) -> list[str]:
    """Everything the fake checks of an object of ``kind`` sent to be created or replaced."""
    errors = validate_meta(kind, obj) + validate_spec(kind, obj)
    if not errors and kind in KINDS:
        errors = model_errors(obj, KINDS[kind][3])
    return errors


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
