"""Who may do what on the fake API server: the authorizer chain ``Node,RBAC`` of a kubeadm cluster.

Read in Kubernetes v1.34.2, v1.35.3 and v1.36.2 (OpenShift's fork of each, as openshift/microshift vendors
it under ``deps/github.com/openshift/kubernetes``; the rules below carry no OpenShift change):
- kubelet's credentials (user ``system:node:<node>``, group ``system:nodes``). The Node authorizer
  (``plugin/pkg/auth/authorizer/node/node_authorizer.go``, ``Authorize``: v1.36.2 lines 109-169) judges
  some resources itself (secrets, configmaps, PVCs, PVs, resourceclaims, volumeattachments,
  serviceaccounts, leases, csinodes, resourceslices, nodes, pods, podcertificaterequests: the fake's
  handlers apply its rules for those it serves) and every other resource by the static rules of
  ``NodeRules()`` (``plugin/pkg/auth/authorizer/rbac/bootstrappolicy/policy.go``: v1.34.2 lines
  189-281, v1.35.3 194-286, v1.36.2 200-292; :data:`NODE_RULES` holds the ones not judged above). Their
  only ``resource.k8s.io`` rules are get on resourceclaims and deletecollection on resourceslices, so a
  node may not get or list **deviceclasses** by them. Where the Node authorizer has no opinion, the chain
  goes on to RBAC, and by default that adds nothing for a node: the ``system:node`` binding has had no
  subjects since 1.8 (policy.go ``ClusterRoleBindings``, v1.36.2 lines 716-720), and the bindings to
  ``system:authenticated`` (system:basic-user, system:discovery, system:public-info-viewer) grant
  self-reviews and non-resource URLs only. deviceclasses are read by the kube-scheduler role (policy.go
  v1.36.2 line 655) and the resource-claim controller (controller_policy.go v1.36.2 line 238), neither
  bound to nodes; a binding an administrator makes to ``system:nodes`` (``dra-manifests
  --kubelet-credentials``'s read-only role) lets them read.
- the driver's service account (``system:serviceaccount:<ns>:<name>``, groups ``system:serviceaccounts``,
  ``system:serviceaccounts:<ns>``, ``system:authenticated``): no default binding grants it any resource
  (``system:service-account-issuer-discovery`` is non-resource URLs), so RBAC is what an administrator
  applied: the ClusterRoles and ClusterRoleBindings in the fake's store, matched as
  ``plugin/pkg/auth/authorizer/rbac/rbac.go`` ``RulesAllow`` does (a verb, group and resource each
  listed or ``*``; ``resourceNames``, when given, must name the object; a subresource is
  ``resource/sub``, or ``*/sub``).

A refusal reads as the apiserver's (``responsewriters.forbiddenMessage``): ``<resource>.<group> is
forbidden: User "<user>" cannot <verb> resource "<resource>" in API group "<group>" at the cluster scope``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

#: NodeRules() of v1.34-v1.36 without the resources the Node authorizer judges itself (its DRA rules,
#: get on resourceclaims and deletecollection on resourceslices, are among those): (groups, resources, verbs).
NODE_RULES: tuple[tuple[frozenset[str], frozenset[str], frozenset[str]], ...] = tuple(
    (frozenset(groups), frozenset(resources), frozenset(verbs))
    for groups, resources, verbs in (
        ([""], ["services"], ["get", "list", "watch"]),
        (["authentication.k8s.io"], ["tokenreviews"], ["create"]),
        (["authorization.k8s.io"], ["subjectaccessreviews", "localsubjectaccessreviews"], ["create"]),
        ([""], ["events"], ["create", "update", "patch"]),
        (["events.k8s.io"], ["events"], ["create", "update", "patch"]),
        ([""], ["endpoints"], ["get"]),
        (["certificates.k8s.io"], ["certificatesigningrequests"], ["create", "get", "list", "watch"]),
        (["storage.k8s.io"], ["csidrivers"], ["get", "list", "watch"]),
        (["node.k8s.io"], ["runtimeclasses"], ["get", "list", "watch"]),
    )
)


@dataclass(frozen=True)
class Attributes:
    """A resource request as the apiserver's RequestInfo sees it."""

    verb: str
    group: str
    resource: str  # with its subresource: "nodes/status"
    namespace: str
    name: str


def attributes(method: str, path: str, query: Mapping[str, str]) -> Attributes | None:
    """The request's verb and resource, or None for a path that names no resource."""
    parts = [p for p in path.split("/") if p]
    if parts[:2] == ["api", "v1"]:
        group, rest = "", parts[2:]
    elif len(parts) >= 3 and parts[0] == "apis":
        group, rest = parts[1], parts[3:]
    else:
        return None
    namespace = ""
    if len(rest) >= 3 and rest[0] == "namespaces":
        namespace, rest = rest[1], rest[2:]
    if not rest:
        return None
    resource, name = rest[0], rest[1] if len(rest) > 1 else ""
    if len(rest) > 2:
        resource += "/" + rest[2]
    if method == "GET":
        verb = ("watch" if query.get("watch") in ("1", "true") else "list") if not name else "get"
    elif method == "DELETE":
        verb = "delete" if name else "deletecollection"
    else:
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method, method.lower())
    return Attributes(verb, group, resource, namespace, name)


def forbidden_message(user: str, attrs: Attributes) -> str:
    """The apiserver's 403 message for ``user`` and ``attrs``."""
    base = attrs.resource.split("/")[0]
    qualified = f"{base}.{attrs.group}" if attrs.group else base
    subject = f'{qualified} "{attrs.name}"' if attrs.name else qualified
    scope = f'in the namespace "{attrs.namespace}"' if attrs.namespace else "at the cluster scope"
    return (
        f'{subject} is forbidden: User "{user}" cannot {attrs.verb} resource "{attrs.resource}" '
        f'in API group "{attrs.group}" {scope}'
    )


#: What the Node authorizer judges itself, by (group, resource) whatever the subresource (``Authorize``'s
#: switch; nodes and pods with AuthorizeNodeWithSelectors, on since 1.32).
NODE_AUTHORIZER_JUDGES = frozenset(
    {
        ("", "secrets"),
        ("", "configmaps"),
        ("", "persistentvolumeclaims"),
        ("", "persistentvolumes"),
        ("", "serviceaccounts"),
        ("", "nodes"),
        ("", "pods"),
        ("resource.k8s.io", "resourceclaims"),
        ("resource.k8s.io", "resourceslices"),
        ("storage.k8s.io", "volumeattachments"),
        ("storage.k8s.io", "csinodes"),
        ("coordination.k8s.io", "leases"),
        ("certificates.k8s.io", "podcertificaterequests"),
    }
)


def node_authorizer_judges(attrs: Attributes) -> bool:
    return (attrs.group, attrs.resource.split("/")[0]) in NODE_AUTHORIZER_JUDGES


def node_rules_allow(attrs: Attributes) -> bool:
    """What the Node authorizer allows a node for a resource it does not judge itself."""
    return any(
        attrs.group in groups and attrs.resource in resources and attrs.verb in verbs
        for groups, resources, verbs in NODE_RULES
    )


def rbac_allows(
    objects: Mapping[tuple[str, str, str], dict[str, Any]], user: str, groups: Iterable[str], attrs: Attributes
) -> bool:
    """Whether a ClusterRoleBinding in ``objects`` binds ``user`` (or one of ``groups``) to a ClusterRole
    whose rules allow ``attrs``."""
    groups = set(groups)
    for (kind, _, _), binding in objects.items():
        if kind != "ClusterRoleBinding" or not any(_names(s, user, groups) for s in binding.get("subjects") or []):
            continue
        ref = binding.get("roleRef") or {}
        role = objects.get(("ClusterRole", "", ref.get("name", ""))) if ref.get("kind") == "ClusterRole" else None
        if role is not None and any(_rule_allows(rule, attrs) for rule in role.get("rules") or []):
            return True
    return False


def _names(subject: Mapping[str, Any], user: str, groups: set[str]) -> bool:
    kind, name = subject.get("kind"), str(subject.get("name", ""))
    if kind == "ServiceAccount":
        return user == f"system:serviceaccount:{subject.get('namespace', '')}:{name}"
    if kind == "User":
        return user == name
    return kind == "Group" and name in groups


def _rule_allows(rule: Mapping[str, Any], attrs: Attributes) -> bool:
    def listed(key: str, value: str) -> bool:
        values: list[str] = rule.get(key) or []
        return "*" in values or value in values

    names = rule.get("resourceNames") or []
    sub = attrs.resource.partition("/")[2]
    return (
        listed("verbs", attrs.verb)
        and listed("apiGroups", attrs.group)
        and (listed("resources", attrs.resource) or (sub != "" and listed("resources", f"*/{sub}")))
        and (not names or attrs.name in names)
    )
