"""``ate-devplugd dra-manifests``: the cluster objects an administrator applies for DRA mode.

- one DeviceClass per resource: a CEL selector on the driver and the device's ``resource`` attribute,
  and ``extendedResourceName`` so that pods asking for ``ate.dev/kvm: 1`` get a claim (KEP-5004);
- only for credentials that are not kubelet's own: a ClusterRole and its binding for the driver's
  service account (what the driver calls, and a read of DeviceClasses for ``doctor``), and a
  ValidatingAdmissionPolicy that lets such a credential write only the ResourceSlices of the node its
  token is bound to (node-bound service-account tokens);
- only for kubelet's own: a read-only ClusterRole on DeviceClasses bound to the group ``system:nodes``
  (``node_read_objects``), so that ``switch-mode`` and ``doctor`` read each class back with kubelet's
  credentials (no rule of the Node authorizer and no default binding lets a node read them; they hold no
  secret, and every scheduler reads them).

- on request (``refuse_multi``), for clusters whose every node serving the resources has the shared
  layout: a ValidatingAdmissionPolicy that refuses a pod whose container (or init container) asks for
  more than 1 of a resource, which a shared device cannot give (the pod would stay Pending for ever).
  Opt-in, because it is cluster-wide and the layout is per node (device-plugin nodes and units nodes
  give 2). Its failurePolicy is Ignore: a policy that cannot be evaluated never blocks a pod, which then
  meets the scheduler as it would without it. Two containers asking 1 each are let through (whether the
  scheduler can give one shared device to two requests of one claim was not measured).

Every name is one the apiserver takes for its kind: the policy, its binding and ``spec.policyName``
must be DNS subdomains (no ``:``, which RBAC names allow), so all four objects share the subdomain
``ate-devplugd.<driver>``. The policy and its binding come before the RBAC that grants the writes it
confines, so an applier that stops at the first refusal never creates the grant alone.

Order in one stream is not enough: the apiserver enforces a new admission policy only after its policy
source refreshes (at most once a second), while an RBAC grant works at once, so one ``kubectl apply``
leaves a window of up to about a second in which the grant is not confined. ``stage`` splits the output
in two: ``policy`` (the DeviceClasses, the namespace and service account, the policy and its binding)
and ``grant`` (the ClusterRole and its binding), to be applied once the policy is in force.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

import yaml

from ate_devplugd.commands.findings import config_error
from ate_devplugd.config.dra import DraConfig
from ate_devplugd.config.pools import API_VERSION, RESOURCE_ATTRIBUTE, class_name

SERVICE_ACCOUNT = ("ate-devplugd", "ate-devplugd")  # namespace, name
#: The two stages of the output: apply ``policy``, wait until the apiserver enforces it, apply ``grant``.
STAGES = ("policy", "grant")
_GRANT_KINDS = ("ClusterRole", "ClusterRoleBinding")
_NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"


def access_name(config: DraConfig) -> str:
    """The name of the ClusterRole, the policy and their bindings: a DNS subdomain, valid for all four."""
    return f"ate-devplugd.{config.driver}"


def device_class(config: DraConfig, resource: str) -> dict[str, Any]:
    expression = (
        f'device.driver == "{config.driver}" && '
        f'device.attributes["{config.driver}"].{RESOURCE_ATTRIBUTE} == "{resource}"'
    )
    return {
        "apiVersion": API_VERSION,
        "kind": "DeviceClass",
        "metadata": {"name": class_name(resource), "labels": {"app.kubernetes.io/managed-by": "ate-devplugd"}},
        "spec": {"selectors": [{"cel": {"expression": expression}}], "extendedResourceName": resource},
    }


def access_objects(config: DraConfig, service_account: tuple[str, str] = SERVICE_ACCOUNT) -> list[dict[str, Any]]:
    """RBAC and the admission policy for a service-account credential (kubelet's needs neither)."""
    namespace, name = service_account
    role = access_name(config)
    user = f"system:serviceaccount:{namespace}:{name}"
    verbs_slices = ["get", "list", "watch", "create", "update", "patch", "delete"]
    grant = [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": role},
            "rules": [
                {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": ["get"]},
                # list and watch: the driver follows its Node until kubelet has created it
                {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]},
                {"apiGroups": ["resource.k8s.io"], "resources": ["resourceslices"], "verbs": verbs_slices},
                # read only: doctor checks each resource's DeviceClass (cluster-wide objects holding no secret;
                # kubelet's credentials may not read them)
                {"apiGroups": ["resource.k8s.io"], "resources": ["deviceclasses"], "verbs": ["get", "list"]},
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": role},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
        },
    ]
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name, "namespace": namespace}},
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicy",
            "metadata": {"name": role},
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {
                    "resourceRules": [
                        {
                            "apiGroups": ["resource.k8s.io"],
                            "apiVersions": ["*"],
                            "operations": ["CREATE", "UPDATE", "DELETE"],
                            "resources": ["resourceslices"],
                        }
                    ]
                },
                "matchConditions": [
                    {"name": "driver-credential", "expression": f'request.userInfo.username == "{user}"'}
                ],
                "variables": [
                    {
                        "name": "tokenNode",
                        "expression": f"request.userInfo.extra[?'{_NODE_NAME_EXTRA}'][0].orValue('')",
                    },
                    {
                        "name": "slice",
                        "expression": 'request.operation == "DELETE" ? oldObject : object',
                    },
                ],
                "validations": [
                    {
                        "expression": 'variables.tokenNode != ""',
                        "message": "the credential is not bound to a node (use a node-bound service-account token)",
                    },
                    {
                        "expression": 'variables.slice.spec.?nodeName.orValue("") == variables.tokenNode',
                        "messageExpression": "'only ResourceSlices of node ' + variables.tokenNode + ' may be written'",
                    },
                    {
                        "expression": f'variables.slice.spec.driver == "{config.driver}"',
                        "message": f"only ResourceSlices of driver {config.driver} may be written",
                    },
                ],
            },
        },
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicyBinding",
            "metadata": {"name": role},
            "spec": {"policyName": role, "validationActions": ["Deny"]},
        },
        *grant,  # after the policy that confines it
    ]


def node_read_name(config: DraConfig) -> str:
    """The ClusterRole, and its binding, that let nodes read DeviceClasses."""
    return f"ate-devplugd.{config.driver}.deviceclass-reader"


def node_read_objects(config: DraConfig) -> list[dict[str, Any]]:
    """Get and list on DeviceClasses for every node's credentials (``system:nodes``), nothing else."""
    name = node_read_name(config)
    return [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": name},
            "rules": [{"apiGroups": ["resource.k8s.io"], "resources": ["deviceclasses"], "verbs": ["get", "list"]}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "system:nodes"}],
        },
    ]


def refuse_multi_name(config: DraConfig) -> str:
    """The name of the pod policy of ``refuse_multi`` and its binding (DNS subdomains)."""
    return f"ate-devplugd-one-each.{config.driver}"


def refuse_multi_objects(config: DraConfig, resources: Sequence[str]) -> list[dict[str, Any]]:
    """A policy, and its binding, refusing a pod whose container asks for more than 1 of a resource."""
    name = refuse_multi_name(config)
    validations = []
    for resource in resources:
        # Extended resources are whole numbers; limits alone, or requests equal to them.
        at_most_one = f"!('{resource}' in m) || quantity(m['{resource}']).compareTo(quantity('1')) <= 0"
        asked = f"[c.?resources.?limits.orValue({{}}), c.?resources.?requests.orValue({{}})].all(m, {at_most_one})"
        validations.append(
            {
                "expression": f"variables.containers.all(c, {asked})",
                "message": f"{resource}: at most 1 per container on this cluster, whose nodes publish it as one shared "
                "device (ate-devplugd in DRA mode, the shared layout), which one request cannot get twice; "
                "ask for 1: one device node serves every VM of the pod",
                "reason": "Invalid",
            }
        )
    return [
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicy",
            "metadata": {"name": name},
            "spec": {
                "failurePolicy": "Ignore",
                "matchConstraints": {
                    "resourceRules": [
                        {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]}
                    ]
                },
                "variables": [
                    {
                        "name": "containers",
                        "expression": "object.spec.containers + object.spec.?initContainers.orValue([])",
                    }
                ],
                "validations": validations,
            },
        },
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicyBinding",
            "metadata": {"name": name},
            "spec": {"policyName": name, "validationActions": ["Deny"]},
        },
    ]


def render(
    config: DraConfig,
    resources: Sequence[str],
    *,
    with_access: bool = True,
    stage: str | None = None,
    refuse_multi: bool = False,
) -> str:
    """The manifests as one multi-document YAML text: all of them, or one ``stage`` of STAGES (which
    implies ``with_access``); with ``refuse_multi``, the pod policy after the DeviceClasses (not in the
    ``grant`` stage)."""
    if stage is not None and stage not in STAGES:
        raise ValueError(f"stage {stage!r}: not one of {', '.join(STAGES)}")
    access = access_objects(config)
    if stage == "grant":
        grant = [doc for doc in access if doc["kind"] in _GRANT_KINDS]
        return (
            "# Stage 2 of 2: the RBAC for the driver's service account. Apply it only once the admission policy\n"
            "# of stage 1 is in force (the apiserver enforces a new policy up to about a second after it is created).\n"
            + yaml.safe_dump_all(grant, sort_keys=False, explicit_start=True, width=4096)
        )
    docs = [device_class(config, resource) for resource in resources]
    text = "# DeviceClasses for ate-devplugd's DRA driver " + config.driver + "\n"
    text += yaml.safe_dump_all(docs, sort_keys=False, explicit_start=True, width=4096)
    if refuse_multi:
        text += (
            "# Only where every node serving these resources has the shared layout: pods asking for more than 1\n"
            "# of one in a container are refused at creation, instead of staying Pending for ever.\n"
        )
        text += yaml.safe_dump_all(
            refuse_multi_objects(config, resources), sort_keys=False, explicit_start=True, width=4096
        )
    if stage == "policy":
        text += (
            "# Stage 1 of 2: an admission policy that limits a node-bound token to its own node's ResourceSlices.\n"
            "# Wait until it is in force before applying stage 2 (--stage grant), which grants the writes.\n"
        )
        policy = [doc for doc in access if doc["kind"] not in _GRANT_KINDS]
        text += yaml.safe_dump_all(policy, sort_keys=False, explicit_start=True, width=4096)
    elif with_access:
        text += (
            "# Only for a kubeconfig that is not kubelet's own: an admission policy that limits a node-bound\n"
            "# token to its own node's ResourceSlices, then the RBAC for the driver's service account.\n"
        )
        text += yaml.safe_dump_all(access, sort_keys=False, explicit_start=True, width=4096)
    else:
        text += (
            "# kubelet's credentials may not read DeviceClasses: this read-only role lets every node read them,\n"
            "# so that switch-mode and doctor check each one back on the node.\n"
        )
        text += yaml.safe_dump_all(node_read_objects(config), sort_keys=False, explicit_start=True, width=4096)
    return text


def main(args: argparse.Namespace) -> int:
    """``dra-manifests``: the objects for the ``[dra]`` table of the config (its defaults without one)."""
    from ate_devplugd import config as configmod  # noqa: PLC0415 - the config only once the line is read
    from ate_devplugd.config import dra as dra_config  # noqa: PLC0415

    try:
        cfg = configmod.load(args.config)
    except configmod.ConfigError as exc:
        return config_error(exc.errors)
    dra = cfg.dra or dra_config.from_mapping(None)[0]
    resources = [dev.resource for dev in cfg.devices]
    text = render(
        dra, resources, with_access=not args.kubelet_credentials, stage=args.stage, refuse_multi=args.refuse_multi
    )
    sys.stdout.write(text)
    return os.EX_OK
