"""``ate-devplugd dra-manifests`` applied, as ``kubectl apply -f -`` would, to the fake API server with
the apiserver's name rules (tests/fakes/apivalidation.py says which it took): every object of both
variants is created, and the rules refuse what the real apiserver refused. Then what each credential may
read (tests/fakes/apiauthz.py: the Node authorizer, and RBAC over what was applied)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import pytest
import yaml

from ate_devplugd import cli
from ate_devplugd.commands import manifests
from ate_devplugd.config.dra import DraConfig
from ate_devplugd.config.pools import DraResource, build_pools, new_slice
from tests.fakes.apiserver import FakeApiServer, collection_path

ADMIN = "admin-t0ken"
NODE_TOKEN = "node-t0ken"
SA_TOKEN = "sa-t0ken"
CONFIG = DraConfig(node_name="node-1")
RESOURCES = ["ate.dev/kvm", "ate.dev/vhost-net"]


def documents(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc is not None]


async def apply(url: str, token: str, docs: list[dict[str, Any]]) -> list[str]:
    """What ``kubectl apply`` does with a stream: each object in turn created (or replaced if it
    exists), going on after a refusal; the refusals, one line each (kubectl then exits 1)."""
    errors: list[str] = []
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    async with aiohttp.ClientSession(headers=headers) as session:
        for doc in docs:
            collection = url + collection_path(doc)
            item = f"{collection}/{quote(doc['metadata']['name'], safe='')}"
            async with session.get(item) as got:
                existing = await got.json() if got.status == 200 else None
            if existing is None:
                call = session.post(collection, data=json.dumps(doc))
            else:
                replaced = {**doc, "metadata": {**doc["metadata"], **_kept(existing["metadata"])}}
                call = session.put(item, data=json.dumps(replaced))
            async with call as answer:
                if answer.status >= 300:
                    body = await answer.json()
                    errors.append(f"{doc['kind']} {doc['metadata']['name']}: {answer.status} {body['message']}")
    return errors


def _kept(meta: dict[str, Any]) -> dict[str, Any]:
    return {key: meta[key] for key in ("resourceVersion", "uid") if key in meta}


@contextlib.asynccontextmanager
async def api_server() -> AsyncIterator[FakeApiServer]:
    api = FakeApiServer("node-1", token=NODE_TOKEN, admin_token=ADMIN, service_account_token=SA_TOKEN)
    await api.start()
    try:
        yield api
    finally:
        await api.stop()


class TestApply:
    @pytest.mark.parametrize("with_access", [True, False], ids=["service-account", "kubelet-credentials"])
    async def test_every_object_is_created(self, with_access: bool) -> None:
        """The whole output applies with no refusal, twice (the second time replaces); every object exists,
        and the binding names the policy and the role that were created."""
        docs = documents(manifests.render(CONFIG, RESOURCES, with_access=with_access))
        async with api_server() as api:
            assert await apply(api.url, ADMIN, docs) == []
            assert await apply(api.url, ADMIN, docs) == []
            for doc in docs:
                meta = doc["metadata"]
                assert api.created(doc["kind"], meta["name"], meta.get("namespace", "")) is not None, doc
            kinds = [doc["kind"] for doc in docs]
            assert kinds.count("DeviceClass") == len(RESOURCES)
            if with_access:
                binding = next(d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding")
                assert api.created("ValidatingAdmissionPolicy", binding["spec"]["policyName"]) is not None
                role_binding = next(d for d in docs if d["kind"] == "ClusterRoleBinding")
                assert api.created("ClusterRole", role_binding["roleRef"]["name"]) is not None
            else:  # and the read-only role that lets nodes read them
                assert set(kinds) == {"DeviceClass", "ClusterRole", "ClusterRoleBinding"}

    def test_policy_comes_before_the_grant(self) -> None:
        """The policy and its binding precede the ClusterRole and its binding that grant the writes."""
        kinds = [doc["kind"] for doc in documents(manifests.render(CONFIG, RESOURCES))]
        policy = max(kinds.index("ValidatingAdmissionPolicy"), kinds.index("ValidatingAdmissionPolicyBinding"))
        assert policy < min(kinds.index("ClusterRole"), kinds.index("ClusterRoleBinding")), kinds

    async def test_node_credential_cannot_apply(self) -> None:
        """The node's own credential may not create cluster objects (the node authorizer)."""
        docs = documents(manifests.render(CONFIG, RESOURCES, with_access=False))
        async with api_server() as api:
            errors = await apply(api.url, NODE_TOKEN, docs)
        assert len(errors) == len(docs) and all(" 403 " in e for e in errors), errors


class TestTheFakeRefusesWhatTheApiserverRefuses:
    """The rules of the real apiserver (as seen on 1.36.2 and in its validation code), one kind each."""

    @pytest.mark.parametrize(
        ("kind", "name", "refused"),
        [
            ("ValidatingAdmissionPolicy", "ate-devplugd:kvm.ate.dev", "a lowercase RFC 1123 subdomain"),
            ("ValidatingAdmissionPolicyBinding", "ate-devplugd:kvm.ate.dev", "a lowercase RFC 1123 subdomain"),
            ("DeviceClass", "Kvm.ate.dev", "a lowercase RFC 1123 subdomain"),
            ("Namespace", "ate.devplugd", "a lowercase RFC 1123 label"),
            ("ServiceAccount", "ate_devplugd", "a lowercase RFC 1123 subdomain"),
            ("ClusterRole", "ate-devplugd/kvm", "may not contain '/'"),
            ("ClusterRoleBinding", "..", "may not be '..'"),
            ("ClusterRole", "ate-devplugd:kvm.ate.dev", ""),
            ("ClusterRoleBinding", "ate-devplugd:kvm.ate.dev", ""),
        ],
    )
    async def test_name_rules(self, kind: str, name: str, refused: str) -> None:
        """metadata.name is checked with its kind's rule: a colon passes in RBAC names only."""
        docs = documents(manifests.render(CONFIG, RESOURCES))
        doc = next(d for d in docs if d["kind"] == kind)
        doc["metadata"]["name"] = name
        setup = [d for d in docs if d["kind"] == "Namespace"] if kind == "ServiceAccount" else []
        async with api_server() as api:
            errors = await apply(api.url, ADMIN, [*setup, doc])
        if refused:
            (error,) = errors
            assert f'metadata.name: Invalid value: "{name}"' in error and refused in error, error
        else:
            assert errors == []

    async def test_policy_name_of_a_binding(self) -> None:
        """spec.policyName of a binding is a DNS subdomain too."""
        (doc,) = [d for d in documents(manifests.render(CONFIG, RESOURCES)) if d["kind"].endswith("PolicyBinding")]
        doc["spec"]["policyName"] = "ate-devplugd:kvm.ate.dev"
        async with api_server() as api:
            (error,) = await apply(api.url, ADMIN, [doc])
        assert 'spec.policyName: Invalid value: "ate-devplugd:kvm.ate.dev"' in error, error

    async def test_service_account_needs_its_namespace(self) -> None:
        """A ServiceAccount in a namespace that does not exist yet is refused (NamespaceLifecycle)."""
        (doc,) = [d for d in documents(manifests.render(CONFIG, RESOURCES)) if d["kind"] == "ServiceAccount"]
        async with api_server() as api:
            (error,) = await apply(api.url, ADMIN, [doc])
        assert '404 namespaces "ate-devplugd" not found' in error, error


async def status_of(url: str, token: str, path: str, method: str = "GET") -> tuple[int, str]:
    """One call's status code and, for an error, the apiserver's message."""
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    async with aiohttp.ClientSession(headers=headers) as session, session.request(method, url + path, data="{}") as got:
        body = await got.json()
        return got.status, body.get("message", "") if got.status >= 300 else ""


CLASSES = "/apis/resource.k8s.io/v1/deviceclasses"
SLICES_OF_ANY_NODE = "/apis/resource.k8s.io/v1/resourceslices"


class TestWhoMayRead:
    """The Node authorizer for kubelet's credentials, RBAC over what was applied for the service account."""

    async def test_node_may_not_read_device_classes(self) -> None:
        """NodeRules() grants a node nothing on deviceclasses, and no default binding does: 403, worded as
        the apiserver words it, for a list and for a get."""
        async with api_server() as api:
            assert await apply(api.url, ADMIN, documents(manifests.render(CONFIG, RESOURCES))) == []
            assert await status_of(api.url, NODE_TOKEN, CLASSES) == (
                403,
                'deviceclasses.resource.k8s.io is forbidden: User "system:node:node-1" cannot list resource '
                '"deviceclasses" in API group "resource.k8s.io" at the cluster scope',
            )
            code, message = await status_of(api.url, NODE_TOKEN, CLASSES + "/kvm.ate.dev")
            assert code == 403, message
            assert message.startswith('deviceclasses.resource.k8s.io "kvm.ate.dev" is forbidden: User "system:node:')

    async def test_kubelet_credentials_variant_lets_nodes_read_device_classes(self) -> None:
        """The service-account variant leaves nodes without a read of DeviceClasses (above); the variant for
        kubelet's credentials binds a read-only role to system:nodes: a node then lists and gets them, and
        may still write none, nor read anything else it could not before."""
        async with api_server() as api:
            assert await apply(api.url, ADMIN, documents(manifests.render(CONFIG, RESOURCES, with_access=False))) == []
            assert (await status_of(api.url, NODE_TOKEN, CLASSES))[0] == 200
            assert (await status_of(api.url, NODE_TOKEN, CLASSES + "/kvm.ate.dev"))[0] == 200
            code, message = await status_of(api.url, NODE_TOKEN, CLASSES, "POST")
            assert code == 403 and "cannot create resource" in message, message
            assert (await status_of(api.url, NODE_TOKEN, "/api/v1/namespaces"))[0] == 403
            assert (await status_of(api.url, SA_TOKEN, CLASSES))[0] == 403  # the service account: nothing

    @pytest.mark.parametrize("with_access", [True, False], ids=["service-account", "kubelet-credentials"])
    async def test_service_account_reads_what_the_role_grants(self, with_access: bool) -> None:
        """Before anything is applied the service account may do nothing; after the service-account
        variant it may read DeviceClasses (get and list, not write) and list every slice and Node, and
        nothing the role does not name; the kubelet-credentials variant grants it nothing."""
        async with api_server() as api:
            assert (await status_of(api.url, SA_TOKEN, CLASSES))[0] == 403
            docs = documents(manifests.render(CONFIG, RESOURCES, with_access=with_access))
            assert await apply(api.url, ADMIN, docs) == []
            granted = {
                path: (await status_of(api.url, SA_TOKEN, path))[0]
                for path in (CLASSES, CLASSES + "/kvm.ate.dev", SLICES_OF_ANY_NODE, "/api/v1/nodes")
            }
            assert granted == dict.fromkeys(granted, 200 if with_access else 403)
            code, message = await status_of(api.url, SA_TOKEN, CLASSES, "POST")
            assert code == 403 and "cannot create resource" in message, message
            code, message = await status_of(api.url, SA_TOKEN, "/api/v1/namespaces")
            assert code == 403 and 'User "system:serviceaccount:ate-devplugd:ate-devplugd" cannot list' in message


def slice_of(node: str) -> dict[str, Any]:
    """A ResourceSlice of ``node`` as the driver writes it (validated by the fake as the apiserver would)."""
    config = DraConfig(node_name=node)
    (pool,), _ = build_pools(config, [DraResource("ate.dev/kvm", "ate.dev/kvm=kvm")])
    return new_slice(config, pool, 1, True, "0d1e5e3a-0000-4000-8000-000000000000")


async def write_slice(url: str, token: str, node: str) -> tuple[int, str]:
    """A create of ``node``'s slice with ``token``: the status code and, for an error, the message."""
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    async with (
        aiohttp.ClientSession(headers=headers) as session,
        session.post(url + SLICES_OF_ANY_NODE, data=json.dumps(slice_of(node))) as got,
    ):
        body = await got.json()
        return got.status, body.get("message", "") if got.status >= 300 else ""


class TestInstallWithoutAWindow:
    """The apiserver enforces a new admission policy only after its policy source refreshes (at most once
    a second) while an RBAC grant works at once (contract §9); the fake holds a policy back until
    ``refresh_policies()``. A token of node-1 tries to write node-2's slice."""

    async def test_one_apply_leaves_a_window(self) -> None:
        """Everything in one apply: until the policy is in force, node-1's token creates node-2's slice
        (what was seen on 1.36.2); once it is, the policy refuses it as the apiserver does."""
        async with api_server() as api:
            api.policy_lag = True
            api.add_node("node-2")
            token = api.mint_token("node-1")
            assert await apply(api.url, ADMIN, documents(manifests.render(CONFIG, RESOURCES))) == []
            assert (await write_slice(api.url, token, "node-2"))[0] == 201
            api.refresh_policies()
            code, message = await write_slice(api.url, token, "node-2")
            assert code == 422, message
            assert (
                "ValidatingAdmissionPolicy 'ate-devplugd.kvm.ate.dev' with binding 'ate-devplugd.kvm.ate.dev' "
                "denied request: only ResourceSlices of node node-1 may be written"
            ) in message

    async def test_two_stages_leave_none(self) -> None:
        """The policy stage, then (once the policy is in force) the grant stage: node-1's token never
        writes node-2's slice, first for want of a grant (403), then by the policy (422); its own it may."""
        async with api_server() as api:
            api.policy_lag = True
            api.add_node("node-2")
            token = api.mint_token("node-1")
            policy = documents(manifests.render(CONFIG, RESOURCES, stage="policy"))
            assert await apply(api.url, ADMIN, policy) == []
            assert (await write_slice(api.url, token, "node-2"))[0] == 403
            api.refresh_policies()  # what the wait between the stages in docs/dra.md is for
            assert await apply(api.url, ADMIN, documents(manifests.render(CONFIG, RESOURCES, stage="grant"))) == []
            assert (await write_slice(api.url, token, "node-2"))[0] == 422
            assert (await write_slice(api.url, token, "node-1"))[0] == 201

    def test_the_stages_make_the_whole(self) -> None:
        """Stage 1 then stage 2 is every object of the one-stream output, in its order; the grant is all
        of stage 2 and none of stage 1."""
        whole = documents(manifests.render(CONFIG, RESOURCES))
        policy = documents(manifests.render(CONFIG, RESOURCES, stage="policy"))
        grant = documents(manifests.render(CONFIG, RESOURCES, stage="grant"))
        assert policy + grant == whole
        assert {d["kind"] for d in grant} == {"ClusterRole", "ClusterRoleBinding"}
        assert not {d["kind"] for d in policy} & {"ClusterRole", "ClusterRoleBinding"}


class TestRefuseMulti:
    """``refuse_multi``: a pod policy for clusters whose nodes all have the shared layout. The fake API server
    does not evaluate CEL (nor serve pods): what is tested here is that the objects are ones the apiserver
    takes (names, fields, order), what the policy matches and how it fails, not the expression's verdicts."""

    def test_the_policy(self) -> None:
        """Pod creates only; failurePolicy Ignore (an expression that cannot be evaluated never blocks a pod);
        one validation per resource over containers and init containers, limits and requests; bound with Deny."""
        docs = documents(manifests.render(CONFIG, RESOURCES, with_access=False, refuse_multi=True))
        assert [d["kind"] for d in docs] == [
            *["DeviceClass"] * len(RESOURCES),
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding",
            "ClusterRole",  # nodes may read the DeviceClasses
            "ClusterRoleBinding",
        ]
        policy, binding = docs[-4:-2]
        spec = policy["spec"]
        assert spec["failurePolicy"] == "Ignore"
        assert spec["matchConstraints"] == {
            "resourceRules": [
                {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]}
            ]
        }
        assert spec["variables"] == [
            {"name": "containers", "expression": "object.spec.containers + object.spec.?initContainers.orValue([])"}
        ]
        assert len(spec["validations"]) == len(RESOURCES)
        for resource, validation in zip(RESOURCES, spec["validations"], strict=True):
            expression = validation["expression"]
            assert expression.startswith("variables.containers.all(c, ")
            assert (
                "c.?resources.?limits.orValue({})" in expression and "c.?resources.?requests.orValue({})" in expression
            )
            assert f"quantity(m['{resource}']).compareTo(quantity('1')) <= 0" in expression
            assert expression.count("(") == expression.count(")") and expression.count("[") == expression.count("]")
            assert validation["message"].startswith(f"{resource}: at most 1 per container")
        assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
        assert binding["metadata"]["name"] == policy["metadata"]["name"] == "ate-devplugd-one-each.kvm.ate.dev"

    def test_only_when_asked_and_never_with_the_grant(self) -> None:
        """Without the flag nothing changes; with it, the pod policy goes with the DeviceClasses, into stage 1."""
        plain = documents(manifests.render(CONFIG, RESOURCES))
        assert all(d["metadata"]["name"] != manifests.refuse_multi_name(CONFIG) for d in plain)
        policy = documents(manifests.render(CONFIG, RESOURCES, stage="policy", refuse_multi=True))
        grant = documents(manifests.render(CONFIG, RESOURCES, stage="grant", refuse_multi=True))
        assert policy + grant == documents(manifests.render(CONFIG, RESOURCES, refuse_multi=True))
        assert sum(d["metadata"]["name"] == manifests.refuse_multi_name(CONFIG) for d in policy) == 2

    async def test_applies_and_leaves_the_slice_policy_alone(self) -> None:
        """Applied beside the slice policy (validated as the apiserver would), the pod policy is no slice
        policy: before the slice policy is in force, nothing confines the grant; after, the slice policy does."""
        async with api_server() as api:
            api.policy_lag = True
            api.add_node("node-2")
            token = api.mint_token("node-1")
            pods_only = documents(manifests.render(CONFIG, RESOURCES, with_access=False, refuse_multi=True))
            assert await apply(api.url, ADMIN, pods_only) == []
            api.refresh_policies()
            whole = documents(manifests.render(CONFIG, RESOURCES, refuse_multi=True))
            assert await apply(api.url, ADMIN, whole) == []
            assert (await write_slice(api.url, token, "node-2"))[0] == 201  # the pod policy confines no slice
            api.refresh_policies()
            code, message = await write_slice(api.url, token, "node-2")
            assert code == 422 and "ValidatingAdmissionPolicy 'ate-devplugd.kvm.ate.dev'" in message

    def test_from_the_command_line(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """``dra-manifests --refuse-multi`` prints the pod policy too; without the flag, none."""
        config = tmp_path / "config.toml"
        config.write_text('[[device]]\nresource = "ate.dev/kvm"\npath = "/dev/kvm"\n')
        common = ["dra-manifests", "--config", str(config), "--kubelet-credentials"]
        assert cli.main([*common, "--refuse-multi"]) == 0
        docs = documents(capsys.readouterr().out)
        names = [d["metadata"]["name"] for d in docs if d["kind"].startswith("ValidatingAdmissionPolicy")]
        assert names and all(name.startswith("ate-devplugd-one-each.") for name in names)
        assert cli.main(common) == 0
        assert not [d for d in documents(capsys.readouterr().out) if d["kind"].startswith("Validating")]
