"""A fake Kubernetes API server for DRA mode: ResourceSlices, ResourceClaims and Nodes, over HTTP(S).

It behaves as the real one does toward a node's DRA driver (Kubernetes 1.36's apiserver; docs/dra.md):
- resourceslices: create (generateName, metadata.generation 1), get, update (resourceVersion must match:
  409; generation bumped on a spec change), delete; list and watch with field selectors
  ``spec.nodeName``/``spec.driver`` and resourceVersion, events as JSON lines on a chunked response,
  BOOKMARK on request, ERROR 410 for a compacted resourceVersion, the watch ended after timeoutSeconds;
- who may do what (``apiauthz``, which names the Kubernetes source): ``token`` is kubelet's credential
  (``system:node:<node>``), judged by the Node authorizer: list/watch of slices need
  ``spec.nodeName=<node>``, create needs ``spec.nodeName`` to be the node (NodeRestriction), and what the
  authorizer does not judge itself, DeviceClasses among it, as ``NodeRules()`` allows, else as RBAC does
  (the chain ``Node,RBAC``: no DeviceClass is readable until an administrator binds a role to the node or
  to ``system:nodes``); ``forbid_after_create = N`` answers 403 to the next N get, update or delete of a
  slice just created (the authorizer's graph lags behind its own watch). ``service_account_token`` is
  the driver's service account with a token bound to this node, judged by RBAC over the ClusterRoles and
  bindings an administrator created here (none: 403 for everything); once a ValidatingAdmissionPolicy
  and a binding of it (Deny) are in force, its slice writes (create, update, delete) are kept to the
  node its token is bound to, as the policy of ``dra-manifests`` keeps them (the fake does not evaluate
  CEL: a bound policy that matches resourceslices stands for that one; one of pods serves no purpose here,
  as the fake serves no pods), refused as the apiserver refuses them (422 Invalid,
  ``ValidatingAdmissionPolicy '<p>' with binding '<b>' denied request: ...``); ``policy_lag = True``:
  a policy created or replaced is in force only after ``refresh_policies()`` (the apiserver's policy
  source refreshes at most once a second, while an RBAC grant works at once: contract §9);
- ``consumable_capacity = False``: the DRAConsumableCapacity gate is off (1.34-1.35 by default) and
  ``allowMultipleAllocations`` is dropped silently (§4b), from what is stored and from a dry-run's answer;
  ``extended_resource = False``: the DRAExtendedResource gate is off (1.34-1.35 by default) and a
  DeviceClass is stored without ``spec.extendedResourceName``, silently (§5);
- ``dryRun=All`` on a slice create: authorized, admitted and validated as a create, answered with the
  object as it would be stored (a generated name, fields of a gate that is off dropped), nothing stored;
- ``kubelet_restarted()``: kubelet's start-up deletes every slice of the node (§2); ``wipe_driver()``:
  kubelet deletes one driver's slices of the node once it stayed away for 30 s (§2);
  ``recreate_node()``: a new Node uid, and the garbage collector deletes slices owned by the old one;
- nodes: get of its own Node; list and watch only with ``metadata.name=<node>`` (the node authorizer
  with AuthorizeNodeWithSelectors, on since 1.32); ``add_node``/``delete_node`` are seen on a watch;
- what ``dra-manifests`` prints, for an administrator's credential (``admin_token``): Namespaces,
  ServiceAccounts (in an existing namespace, as the NamespaceLifecycle admission plugin demands),
  ClusterRoles and their bindings, ValidatingAdmissionPolicies and their bindings, DeviceClasses:
  created (POST; 409 if the name is taken), read, replaced (PUT), or put in place by ``create()``; the
  node's credential gets 403;
- objects sent are validated as the apiserver would (422 Invalid, names per kind: see apivalidation),
  and, where the ``kubernetes`` PyPI client is installed (the venv), against its v1 models: a field the
  real API does not know fails;
- node-bound service-account tokens (``mint_token()``, as ``kubectl create token --bound-object-kind
  Node`` makes them): none can be made for a Node that does not exist (``nodes "<node>" not found``), and
  one stops authenticating (401) once its Node is deleted or created again (a new uid), or once
  ``expire_token()`` says its time is up (the token authenticator checks the bound object's uid and the
  expiry at every request);
- ``hold_creates()``: slice creates wait until ``release_creates()`` (to put an event between a
  deletion and the republish); ``stop()`` then ``start()`` again serves the same port and the same store
  (an API server outage);
- an API server that has just started answers before its informers have synced (seen on 1.36.2, and
  the contract's §9): ``authenticators_ready = False`` answers 401 to service-account tokens (the token
  authenticator looks up a bound token's ServiceAccount and Node in its informers); ``authorizers_ready =
  False`` gives RBAC no binding yet (the service account: 403) and the Node authorizer an empty graph (a
  node's get, update and delete of a slice and its get of a claim: 403; what NodeRestriction and the
  selector rules decide without the graph, creates and list/watch and its own Node, still pass).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import enum
import itertools
import json
import re
import ssl
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from tests.fakes import apiauthz
from tests.fakes.apivalidation import (
    Problem,
    field_value,
    generated_name,
    parse_selector,
    status,
    validate_meta,
    validate_object,
    validate_slice,
)

if TYPE_CHECKING:  # only a type here: the package test runs this without python3-cryptography
    from tests.fakes.certs import Pki

SLICES = "/apis/resource.k8s.io/v1/resourceslices"
NODES = "/api/v1/nodes"
#: The service account ``dra-manifests`` binds: (namespace, name).
SERVICE_ACCOUNT = ("ate-devplugd", "ate-devplugd")
#: What the Node authorizer judges itself and this fake's handlers judge as it does (a claim: any, as if
#: every claim belonged to a pod bound to the node).
_NODE_HANDLED = {
    ("", "nodes"),
    ("", "pods"),
    ("resource.k8s.io", "resourceslices"),
    ("resource.k8s.io", "resourceclaims"),
}
PODS = "/api/v1/pods"
#: What NodeRestriction lets a node change on its own Node by a patch (it does not look at
#: ``spec.unschedulable``; annotations are a node's own; taints, labels, ownerReferences are not).
_NODE_MAY_PATCH = {"spec": {"unschedulable"}, "metadata": {"annotations"}}
#: Where each kind ``dra-manifests`` prints is created: its collection path ({ns}: its namespace).
COLLECTIONS = {
    "Namespace": "/api/v1/namespaces",
    "ServiceAccount": "/api/v1/namespaces/{ns}/serviceaccounts",
    "ClusterRole": "/apis/rbac.authorization.k8s.io/v1/clusterroles",
    "ClusterRoleBinding": "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
    "ValidatingAdmissionPolicy": "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies",
    "ValidatingAdmissionPolicyBinding": "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicybindings",
    "DeviceClass": "/apis/resource.k8s.io/v1/deviceclasses",
}


def merge_patch(target: dict[str, Any], patch: dict[str, Any]) -> None:
    """RFC 7386: ``patch`` merged into ``target`` (null removes a key)."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            merge_patch(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


def collection_path(obj: dict[str, Any]) -> str:
    """The collection an object of a manifest kind is POSTed to."""
    return COLLECTIONS[obj["kind"]].format(ns=(obj.get("metadata") or {}).get("namespace", ""))


class Caller(enum.Enum):
    """Whose credential a request carries (the administrator's is served apart)."""

    NODE = "node"  # kubelet's: system:node:<node>, group system:nodes
    SERVICE_ACCOUNT = "service-account"  # the driver's service account, its token bound to the node


@dataclass
class _Watcher:
    resource: str
    selector: dict[str, str]
    bookmarks: bool
    queue: asyncio.Queue[dict[str, Any] | None] = field(default_factory=asyncio.Queue)


class FakeApiServer:
    def __init__(
        self,
        node_name: str = "node-1",
        *,
        token: str | None = None,
        pki: Pki | None = None,
        admin_token: str | None = None,
        service_account_token: str | None = None,
        service_account: tuple[str, str] = SERVICE_ACCOUNT,
        with_node: bool = True,
    ) -> None:
        self.node_name = node_name
        self.token = token
        self.admin_token = admin_token
        self.service_account_token = service_account_token
        self.service_account = service_account
        self.pki = pki
        self.consumable_capacity = True
        #: The DRAExtendedResource gate (off: a DeviceClass is stored without ``extendedResourceName``).
        self.extended_resource = True
        self.forbid_after_create = 0
        self.authenticators_ready = True
        self.authorizers_ready = True
        #: Node-bound service-account tokens: token -> (node name, the Node's uid when it was minted).
        self.bound_tokens: dict[str, tuple[str, str]] = {}
        #: Answers 401 (credentials refused or not known yet), as they were given.
        self.unauthorized_answers = 0
        self.policy_lag = False
        #: The admission policies and bindings in force: (kind, namespace, name) -> object.
        self._policies: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.nodes: dict[str, dict[str, Any]] = {}
        self.claims: dict[tuple[str, str], dict[str, Any]] = {}
        self.slices: dict[str, dict[str, Any]] = {}
        #: Pods by (namespace, name), as the fake scheduler and kubelet of ``scheduler.py`` write them.
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        #: Told of every change stored (its resource: "nodes", "pods", "resourceslices").
        self.listeners: list[Any] = []
        #: What an administrator created: (kind, namespace, name) -> object. Its ClusterRoles and
        #: bindings are the RBAC that judges the service account.
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.changes: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue()
        self.requests: list[str] = []
        #: Every request, as it arrives (a test can wait for one).
        self.arrivals: asyncio.Queue[str] = asyncio.Queue()
        self.forbidden_answers = 0
        #: Slice creates made with ``dryRun=All`` (answered as a create would be, nothing stored).
        self.dry_runs = 0
        self._rv = itertools.count(100)
        self._history: list[tuple[int, str, str, dict[str, Any]]] = []
        self._compacted = 0
        self._forbidden: dict[str, int] = {}
        self._watchers: list[_Watcher] = []
        self._runner: web.AppRunner | None = None
        self._creates_open: asyncio.Event | None = None
        self.port = 0
        self.url = ""
        if with_node:
            self.add_node(node_name)

    # -- set-up -------------------------------------------------------------------------------------
    def add_node(self, name: str) -> dict[str, Any]:
        """A Node created (or created again: a new uid), seen by watches of nodes."""
        node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "uid": str(uuid.uuid4())}}
        self.nodes[name] = node
        self._record("nodes", "ADDED", node)
        return node

    def set_node_status(self, allocatable: dict[str, str], capacity: dict[str, str], kubelet_version: str = "") -> None:
        """kubelet's node-status update: the Node's allocatable and capacity as it reports them (and, given,
        ``status.nodeInfo.kubeletVersion``)."""
        node = self.nodes[self.node_name]
        node["status"] = {"allocatable": dict(allocatable), "capacity": dict(capacity)}
        if kubelet_version:
            node["status"]["nodeInfo"] = {"kubeletVersion": kubelet_version}
        self._record("nodes", "MODIFIED", node)

    def put_pod(self, pod: dict[str, Any]) -> None:
        """A pod created or changed (the scheduler's binding, kubelet's status)."""
        key = (pod["metadata"]["namespace"], pod["metadata"]["name"])
        kind = "MODIFIED" if key in self.pods else "ADDED"
        self.pods[key] = pod
        self._record("pods", kind, pod)

    def remove_pod(self, namespace: str, name: str) -> None:
        pod = self.pods.pop((namespace, name), None)
        if pod is not None:
            self._record("pods", "DELETED", pod)

    def delete_node(self, name: str) -> None:
        """A Node deleted; the garbage collector then deletes the slices it owns."""
        uid = self.nodes[name]["metadata"]["uid"]
        self._record("nodes", "DELETED", self.nodes.pop(name))
        self._collect_garbage(uid)

    def mint_token(self, node: str | None = None) -> str:
        """A service-account token bound to Node ``node`` (this one by default), as ``kubectl create token
        --bound-object-kind Node`` makes it; ValueError if that Node does not exist."""
        name = self.node_name if node is None else node
        if name not in self.nodes:
            raise ValueError(f'nodes "{name}" not found')
        token = "sa." + uuid.uuid4().hex
        self.bound_tokens[token] = (name, self.nodes[name]["metadata"]["uid"])
        return token

    def refresh_policies(self) -> None:
        """The apiserver's policy source refreshes: the policies and bindings stored now are in force."""
        kinds = ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
        self._policies = {key: copy.deepcopy(obj) for key, obj in self.objects.items() if key[0] in kinds}

    def _policy_in_force(self) -> tuple[str, str] | None:
        """(policy, binding) of a policy of resourceslices bound with Deny and in force, if any."""
        for (kind, _, name), binding in self._policies.items():
            spec = binding.get("spec") or {}
            policy = spec.get("policyName", "")
            if (
                kind == "ValidatingAdmissionPolicyBinding"
                and "resourceslices" in self._matched(("ValidatingAdmissionPolicy", "", policy))
                and "Deny" in (spec.get("validationActions") or [])
            ):
                return policy, name
        return None

    def _matched(self, key: tuple[str, str, str]) -> set[str]:
        """The resources a policy in force matches (none if it is not in force)."""
        rules = ((self._policies.get(key) or {}).get("spec") or {}).get("matchConstraints", {}).get("resourceRules")
        return {resource for rule in rules or [] for resource in rule.get("resources") or []}

    def expire_token(self, token: str) -> None:
        """The token's expiry passed: it authenticates no more."""
        self.bound_tokens.pop(token, None)

    def hold_creates(self) -> None:
        """Slice creates wait (their request arrived) until ``release_creates()``."""
        self._creates_open = asyncio.Event()

    def release_creates(self) -> None:
        if self._creates_open is not None:
            self._creates_open.set()
        self._creates_open = None

    def add_claim(self, namespace: str, name: str, results: list[dict[str, Any]] | None) -> str:
        """A claim; ``results`` None means not allocated. Returns its uid."""
        uid = str(uuid.uuid4())
        claim: dict[str, Any] = {"metadata": {"namespace": namespace, "name": name, "uid": uid}, "status": {}}
        if results is not None:
            claim["status"]["allocation"] = {"devices": {"results": results}}
        self.claims[(namespace, name)] = claim
        return uid

    async def next_request(self, prefix: str, timeout: float = 5.0) -> str:
        """The next request (``METHOD path?query``) that starts with ``prefix``."""
        async with asyncio.timeout(timeout):
            while not (request := await self.arrivals.get()).startswith(prefix):
                pass
        return request

    async def start(self, port: int | None = None) -> str:
        """Serve (again: on the port served before, with the same store)."""
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        tls = None
        if self.pki is not None:
            tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(self.pki.ca))
            tls.load_cert_chain(str(self.pki.server_cert), str(self.pki.server_key))
            tls.verify_mode = ssl.CERT_REQUIRED
        site = web.TCPSite(self._runner, "127.0.0.1", self.port if port is None else port, ssl_context=tls)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        return self.url

    async def stop(self) -> None:
        for watcher in self._watchers:
            watcher.queue.put_nowait(None)
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    # -- what kubelet, the garbage collector and etcd do ------------------------------------------------
    def kubelet_restarted(self) -> list[str]:
        """Kubelet's start: delete every ResourceSlice of this node, whatever its driver."""
        names = [n for n, s in self.slices.items() if s["spec"].get("nodeName") == self.node_name]
        for name in names:
            self._delete(name)
        return names

    def wipe_driver(self, driver: str) -> list[str]:
        """Kubelet's wipe of a driver gone for its grace: delete the driver's slices of this node."""
        names = [
            n
            for n, s in self.slices.items()
            if s["spec"].get("nodeName") == self.node_name and s["spec"].get("driver") == driver
        ]
        for name in names:
            self._delete(name)
        return names

    def recreate_node(self) -> None:
        old = self.nodes[self.node_name]["metadata"]["uid"]
        self.add_node(self.node_name)
        self._collect_garbage(old)

    def _collect_garbage(self, owner_uid: str) -> None:
        for name, obj in list(self.slices.items()):
            if any(o.get("uid") == owner_uid for o in obj["metadata"].get("ownerReferences") or []):
                self._delete(name)

    def compact(self) -> None:
        """etcd compaction: a watch from an older resourceVersion gets ERROR 410."""
        self._compacted = self._history[-1][0] if self._history else 0

    def created(self, kind: str, name: str, namespace: str = "") -> dict[str, Any] | None:
        """The object of a manifest kind an administrator created, if it exists."""
        return self.objects.get((kind, namespace, name))

    def create(self, *objs: dict[str, Any]) -> None:
        """Objects of manifest kinds created as an administrator's POST would create them (validated)."""
        for obj in objs:
            namespace = (obj.get("metadata") or {}).get("namespace", "")
            self._store(obj["kind"], "POST", namespace, "", obj)

    def end_watches(self) -> None:
        """End every open watch, as the apiserver does after timeoutSeconds or on restart."""
        for watcher in self._watchers:
            watcher.queue.put_nowait(None)

    def bookmark(self) -> None:
        rv = str(next(self._rv))
        for watcher in self._watchers:
            if watcher.bookmarks and watcher.resource == "resourceslices":
                watcher.queue.put_nowait(
                    {
                        "type": "BOOKMARK",
                        "object": {
                            "kind": "ResourceSlice",
                            "apiVersion": "resource.k8s.io/v1",
                            "metadata": {"resourceVersion": rv},
                        },
                    }
                )

    def node_slices(self) -> list[dict[str, Any]]:
        return [s for s in self.slices.values() if s["spec"].get("nodeName") == self.node_name]

    async def next_change(self, *kinds: str, timeout: float = 5.0) -> tuple[str, dict[str, Any]]:
        async with asyncio.timeout(timeout):
            while True:
                kind, obj = await self.changes.get()
                if not kinds or kind in kinds:
                    return kind, obj

    # -- storage ------------------------------------------------------------------------------------
    def _record(self, resource: str, kind: str, obj: dict[str, Any]) -> None:
        rv = next(self._rv)
        obj["metadata"]["resourceVersion"] = str(rv)
        snapshot = copy.deepcopy(obj)
        self._history.append((rv, resource, kind, snapshot))
        if resource == "resourceslices":
            self.changes.put_nowait((kind, snapshot))
        for listener in self.listeners:
            listener(resource)
        for watcher in self._watchers:
            if watcher.resource == resource and self._selected(snapshot, watcher.selector):
                watcher.queue.put_nowait({"type": kind, "object": snapshot})

    def _delete(self, name: str) -> dict[str, Any]:
        obj = self.slices.pop(name)
        self._forbidden.pop(name, None)
        self._record("resourceslices", "DELETED", obj)
        return obj

    @staticmethod
    def _selected(obj: dict[str, Any], selector: dict[str, str]) -> bool:
        return all(field_value(obj, key) == value for key, value in selector.items())

    # -- HTTP ---------------------------------------------------------------------------------------
    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(f"{request.method} {request.path_qs}")
        self.arrivals.put_nowait(self.requests[-1])
        try:
            return await self._route(request)
        except Problem as p:
            if p.code == 403:
                self.forbidden_answers += 1
            if p.code == 401:
                self.unauthorized_answers += 1
            return web.json_response(status(p.code, p.reason, p.message), status=p.code)

    async def _route(self, request: web.Request) -> web.StreamResponse:  # noqa: PLR0911 - one return per route
        path, method = request.path, request.method
        bearer = request.headers.get("Authorization")
        if self.admin_token is not None and bearer == f"Bearer {self.admin_token}":
            return await self._admin(request)
        caller = self._authorize(request, bearer)
        token_node = self._token_node(bearer)
        if path.startswith(NODES) and method == "GET":
            return await self._nodes(request, caller)
        if path.startswith(NODES + "/") and method == "PATCH":
            return web.json_response(await self._patch_node(request, caller))
        if path == PODS and method == "GET":
            selector = parse_selector(request.query.get("fieldSelector", ""))
            if caller is Caller.NODE and selector.get("spec.nodeName") != self.node_name:
                raise Problem(403, "Forbidden", f"node '{self.node_name}' can only list/watch pods bound to it")
            if request.query.get("watch") in ("1", "true"):
                return await self._watch(request, "pods", selector)
            return web.json_response(self._list("PodList", self.pods.values(), selector))
        if m := re.fullmatch(r"/apis/resource.k8s.io/v1/namespaces/([^/]+)/resourceclaims/([^/]+)", path):
            return web.json_response(self._get(self.claims, (m[1], m[2]), "resourceclaims.resource.k8s.io"))
        if path.startswith(COLLECTIONS["DeviceClass"]) and method == "GET":
            return self._device_classes(path)
        if path == SLICES and method == "POST":
            body = await self._body(request)
            dry_run = self._dry_run(request)
            return web.json_response(await self._create(body, caller, token_node, dry_run=dry_run), status=201)
        if path == SLICES and method == "GET":
            selector = self._selector(request.query.get("fieldSelector", ""), caller)
            if request.query.get("watch") in ("1", "true"):
                return await self._watch(request, "resourceslices", selector)
            return web.json_response(self._list("ResourceSliceList", self.slices.values(), selector))
        if m := re.fullmatch(SLICES + r"/([^/]+)", path):
            return await self._slice(request, m[1], caller, token_node)
        raise Problem(404, "NotFound", f"the server could not find the requested resource ({method} {path})")

    async def _slice(self, request: web.Request, name: str, caller: Caller, token_node: str) -> web.StreamResponse:
        """GET, PUT or DELETE of one slice."""
        method = request.method
        if self._forbidden.get(name, 0) > 0:
            self._forbidden[name] -= 1
            raise Problem(
                403,
                "Forbidden",
                f"node '{self.node_name}' cannot {method} resourceslice {name}: "
                "no relationship to this object was found in the node authorizer graph",
            )
        if method == "GET":
            return web.json_response(self._get(self.slices, name, "resourceslices.resource.k8s.io"))
        if method == "PUT":
            body = await self._body(request)
            return web.json_response(self._update(name, body, caller, token_node))
        if method == "DELETE":
            old = self._get(self.slices, name, "resourceslices.resource.k8s.io")
            if caller is Caller.SERVICE_ACCOUNT:
                self._confine(old, token_node)
            return web.json_response(self._delete(name))
        raise Problem(405, "MethodNotAllowed", f"{method} is not supported here")

    def _device_classes(self, path: str) -> web.StreamResponse:
        """List or get the DeviceClasses an administrator created."""
        if path == COLLECTIONS["DeviceClass"]:
            items = [copy.deepcopy(o) for (kind, _, _), o in self.objects.items() if kind == "DeviceClass"]
            return web.json_response({"kind": "DeviceClassList", "apiVersion": "resource.k8s.io/v1", "items": items})
        name = path.removeprefix(COLLECTIONS["DeviceClass"] + "/")
        return web.json_response(self._get(self.objects, ("DeviceClass", "", name), "deviceclasses.resource.k8s.io"))

    def _authorize(self, request: web.Request, bearer: str | None) -> Caller:
        """Who the request is from, and whether that credential may make it (``apiauthz``); the Node
        authorizer's rules for the resources it judges itself are applied by the handlers."""
        token = bearer.removeprefix("Bearer ") if bearer else ""
        if token in self.bound_tokens:
            name, uid = self.bound_tokens[token]
            if self.nodes.get(name, {}).get("metadata", {}).get("uid") != uid:  # its Node is gone, or new
                raise Problem(401, "Unauthorized", "Unauthorized")
            caller = Caller.SERVICE_ACCOUNT
        elif self.service_account_token is not None and bearer == f"Bearer {self.service_account_token}":
            caller = Caller.SERVICE_ACCOUNT
        elif self.token is None or bearer == f"Bearer {self.token}":
            caller = Caller.NODE
        else:
            raise Problem(401, "Unauthorized", "Unauthorized")
        if caller is Caller.SERVICE_ACCOUNT and not self.authenticators_ready:
            raise Problem(401, "Unauthorized", "Unauthorized")
        attrs = apiauthz.attributes(request.method, request.path, request.query)
        if attrs is None:
            return caller
        if caller is Caller.SERVICE_ACCOUNT:
            namespace, name = self.service_account
            user = f"system:serviceaccount:{namespace}:{name}"
            groups = ["system:serviceaccounts", f"system:serviceaccounts:{namespace}", "system:authenticated"]
            rbac = self.objects if self.authorizers_ready else {}
            if not apiauthz.rbac_allows(rbac, user, groups, attrs):
                raise Problem(403, "Forbidden", apiauthz.forbidden_message(user, attrs))
            return caller
        judged = apiauthz.node_authorizer_judges(attrs)
        graph_needed = attrs.verb in ("get", "update", "patch", "delete") and attrs.resource.split("/")[0] != "nodes"
        if judged and (
            (attrs.group, attrs.resource.split("/")[0]) not in _NODE_HANDLED  # no graph: nothing is related
            or (graph_needed and not self.authorizers_ready)  # its graph is empty until its informers sync
        ):
            raise Problem(403, "Forbidden", f"no relationship found between node '{self.node_name}' and this object")
        user = f"system:node:{self.node_name}"
        if not judged and not apiauthz.node_rules_allow(attrs):
            # the Node authorizer has no opinion: RBAC decides, with the bindings an administrator made
            rbac = self.objects if self.authorizers_ready else {}
            if not apiauthz.rbac_allows(rbac, user, ["system:nodes", "system:authenticated"], attrs):
                raise Problem(403, "Forbidden", apiauthz.forbidden_message(user, attrs))
        return caller

    async def _nodes(self, request: web.Request, caller: Caller) -> web.StreamResponse:
        """GET of a Node; the node's credential reads only its own, and lists and watches only with
        ``metadata.name=<node>`` (AuthorizeNodeWithSelectors)."""
        node = caller is Caller.NODE
        if m := re.fullmatch(NODES + r"/([^/]+)", request.path):
            if node and m[1] != self.node_name:
                raise Problem(403, "Forbidden", f"node '{self.node_name}' cannot read '{m[1]}'")
            return web.json_response(self._get(self.nodes, m[1], "nodes"))
        if request.path != NODES:
            raise Problem(404, "NotFound", f"the server could not find the requested resource ({request.path})")
        selector = parse_selector(request.query.get("fieldSelector", ""))
        if node and selector != {"metadata.name": self.node_name}:
            raise Problem(403, "Forbidden", f"node '{self.node_name}' can only list/watch its own Node")
        if request.query.get("watch") in ("1", "true"):
            return await self._watch(request, "nodes", selector)
        return web.json_response(self._list("NodeList", self.nodes.values(), selector))

    async def _patch_node(self, request: web.Request, caller: Caller) -> dict[str, Any]:
        """A JSON merge patch of a Node; a node patches only its own, and only what NodeRestriction lets it."""
        name = request.path.removeprefix(NODES + "/")
        if request.headers.get("Content-Type") != "application/merge-patch+json":
            raise Problem(415, "UnsupportedMediaType", "the body of the request was in an unknown format")
        patch = await self._body(request)
        if caller is Caller.NODE:
            if name != self.node_name:
                raise Problem(403, "Forbidden", f"node '{self.node_name}' cannot modify node '{name}'")
            for key, value in patch.items():
                allowed = _NODE_MAY_PATCH.get(key)
                if allowed is None or not isinstance(value, dict) or set(value) - allowed:
                    raise Problem(403, "Forbidden", f"node '{self.node_name}' is not allowed to modify {key}")
        self._get(self.nodes, name, "nodes")  # 404 when there is none
        node = self.nodes[name]
        merge_patch(node, patch)
        self._record("nodes", "MODIFIED", node)
        return copy.deepcopy(node)

    def _list(self, kind: str, objs: Any, selector: dict[str, str]) -> dict[str, Any]:
        items = [copy.deepcopy(o) for o in objs if self._selected(o, selector)]
        rv = str(self._history[-1][0]) if self._history else "1"
        return {"kind": kind, "metadata": {"resourceVersion": rv}, "items": items}

    async def _admin(self, request: web.Request) -> web.StreamResponse:
        """An administrator applying manifests: create, get, replace the kinds ``dra-manifests`` prints."""
        path, method = request.path, request.method
        for kind, template in COLLECTIONS.items():
            pattern = re.escape(template).replace(re.escape("{ns}"), "(?P<ns>[^/]+)") + "(?:/(?P<name>[^/]+))?"
            if m := re.fullmatch(pattern, path):
                namespace, name = m.groupdict().get("ns") or "", m["name"] or ""
                if method == "GET" and name:
                    resource = template.rsplit("/", 1)[1]
                    return web.json_response(self._get(self.objects, (kind, namespace, name), resource))
                body = await self._body(request) if method in ("POST", "PUT") else None
                obj = self._store(kind, method, namespace, name, body)
                return web.json_response(obj, status=201 if method == "POST" else 200)
        raise Problem(404, "NotFound", f"the server could not find the requested resource ({method} {path})")

    def _store(self, kind: str, method: str, namespace: str, name: str, body: dict[str, Any] | None) -> dict[str, Any]:
        """An administrator's create (POST) or replace (PUT) of a manifest kind, checked as the apiserver does."""
        resource = COLLECTIONS[kind].rsplit("/", 1)[1]
        if method not in ("POST", "PUT") or body is None or (method == "POST") == bool(name):
            raise Problem(405, "MethodNotAllowed", f"{method} is not supported here")
        if body.get("kind") != kind:
            raise Problem(400, "BadRequest", f"the body is a {body.get('kind')!r}, not a {kind}")
        if (body.get("metadata") or {}).get("namespace", namespace) != namespace:
            raise Problem(400, "BadRequest", "the namespace of the object does not match the namespace of the request")
        errors = validate_object(kind, body)
        if errors:
            shown = (body.get("metadata") or {}).get("name", "")
            raise Problem(422, "Invalid", f'{kind} "{shown}" is invalid: ' + "; ".join(errors))
        if namespace and ("Namespace", "", namespace) not in self.objects:  # the NamespaceLifecycle admission plugin
            raise Problem(404, "NotFound", f'namespaces "{namespace}" not found')
        key = (kind, namespace, body["metadata"]["name"])
        if method == "POST" and key in self.objects:
            raise Problem(409, "AlreadyExists", f'{resource} "{key[2]}" already exists')
        if method == "PUT" and (key[2] != name or key not in self.objects):
            raise Problem(404, "NotFound", f'{resource} "{name}" not found')
        obj = copy.deepcopy(body)
        if kind == "DeviceClass" and not self.extended_resource:  # the gate off: the field dropped, silently
            (obj.get("spec") or {}).pop("extendedResourceName", None)
        obj["metadata"]["uid"] = self.objects[key]["metadata"]["uid"] if key in self.objects else str(uuid.uuid4())
        obj["metadata"]["resourceVersion"] = str(next(self._rv))
        self.objects[key] = obj
        if not self.policy_lag:
            self.refresh_policies()
        return copy.deepcopy(obj)

    @staticmethod
    def _get(store: dict[Any, dict[str, Any]], key: Any, what: str) -> dict[str, Any]:
        if key not in store:
            name = key[-1] if isinstance(key, tuple) else key
            raise Problem(404, "NotFound", f'{what} "{name}" not found')
        return copy.deepcopy(store[key])

    @staticmethod
    async def _body(request: web.Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.read())
        except ValueError:
            raise Problem(400, "BadRequest", "the body is not JSON") from None
        if not isinstance(body, dict):
            raise Problem(400, "BadRequest", "the body is not an object")
        return body

    def _selector(self, text: str, caller: Caller) -> dict[str, str]:
        selector = parse_selector(text)
        if caller is Caller.NODE and selector.get("spec.nodeName") != self.node_name:  # AuthorizeNodeWithSelectors
            raise Problem(
                403, "Forbidden", "can only list/watch/deletecollection resourceslices with nodeName field selector"
            )
        return selector

    def _token_node(self, bearer: str | None) -> str:
        """The node a service-account token is bound to (the static one: this node)."""
        token = bearer.removeprefix("Bearer ") if bearer else ""
        return self.bound_tokens[token][0] if token in self.bound_tokens else self.node_name

    def _dry_run(self, request: web.Request) -> bool:
        """``dryRun=All``: the request goes through authorization, admission and validation, and nothing
        is stored (the only value the apiserver takes; another is 400)."""
        values = request.query.getall("dryRun", [])
        if any(value != "All" for value in values):
            raise Problem(400, "BadRequest", f"Invalid dry run value: {values}")
        if values:
            self.dry_runs += 1
        return bool(values)

    async def _create(self, body: dict[str, Any], caller: Caller, token_node: str, *, dry_run: bool) -> dict[str, Any]:
        if self._creates_open is not None and not dry_run:
            await self._creates_open.wait()
        obj = self._admit(body, None, caller, token_node)
        meta = obj["metadata"]
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = generated_name(meta["generateName"], uuid.uuid4().hex[:5])
        errors = validate_meta("ResourceSlice", obj)
        if errors:
            raise Problem(422, "Invalid", "ResourceSlice is invalid: " + "; ".join(errors))
        if meta["name"] in self.slices:
            raise Problem(409, "AlreadyExists", f'resourceslices.resource.k8s.io "{meta["name"]}" already exists')
        meta.update(uid=str(uuid.uuid4()), generation=1, creationTimestamp="2026-01-01T00:00:00Z")
        if dry_run:
            return obj
        self.slices[meta["name"]] = obj
        if self.forbid_after_create and caller is Caller.NODE:
            self._forbidden[meta["name"]] = self.forbid_after_create
        self._record("resourceslices", "ADDED", obj)
        return copy.deepcopy(obj)

    def _update(self, name: str, body: dict[str, Any], caller: Caller, token_node: str) -> dict[str, Any]:
        old = self._get(self.slices, name, "resourceslices.resource.k8s.io")
        obj = self._admit(body, old, caller, token_node)
        errors = validate_meta("ResourceSlice", obj)
        if obj["metadata"].get("name") != name:
            errors.append("metadata.name: Invalid value: field is immutable")
        if errors:
            raise Problem(422, "Invalid", "ResourceSlice is invalid: " + "; ".join(errors))
        if obj["metadata"].get("resourceVersion") != old["metadata"]["resourceVersion"]:
            raise Problem(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on resourceslices.resource.k8s.io "{name}": '
                "the object has been modified; please apply your changes to the latest version and try again",
            )
        for key in ("uid", "creationTimestamp", "name"):
            obj["metadata"][key] = old["metadata"][key]
        changed = obj["spec"] != old["spec"]
        obj["metadata"]["generation"] = old["metadata"]["generation"] + (1 if changed else 0)
        self.slices[name] = obj
        self._record("resourceslices", "MODIFIED", obj)
        return copy.deepcopy(obj)

    def _confine(self, obj: dict[str, Any], token_node: str) -> None:
        """The admission policy of ``dra-manifests``, once in force: a service account's token writes only
        the slices of the node it is bound to."""
        in_force = self._policy_in_force()
        node = (obj.get("spec") or {}).get("nodeName", "")
        if in_force is not None and node != token_node:
            policy, binding = in_force
            name = (obj.get("metadata") or {}).get("name", "")
            raise Problem(
                422,
                "Invalid",
                f'resourceslices.resource.k8s.io "{name}" is forbidden: ValidatingAdmissionPolicy '
                f"'{policy}' with binding '{binding}' denied request: only ResourceSlices of node "
                f"{token_node} may be written",
            )

    def _admit(
        self, body: dict[str, Any], old: dict[str, Any] | None, caller: Caller, token_node: str
    ) -> dict[str, Any]:
        """Validation, NodeRestriction (or, for the service account, the admission policy of
        ``dra-manifests``) and the dropping of fields whose feature gate is off."""
        errors = validate_slice(body, old)
        if errors:
            raise Problem(422, "Invalid", "ResourceSlice is invalid: " + "; ".join(errors))
        if caller is Caller.SERVICE_ACCOUNT:
            self._confine(body, token_node)
            if old is not None:
                self._confine(old, token_node)
        elif body["spec"].get("nodeName") != self.node_name:
            raise Problem(403, "Forbidden", f"node '{self.node_name}' cannot create a ResourceSlice of another node")
        obj = copy.deepcopy(body)
        if not self.consumable_capacity:
            for device in obj["spec"].get("devices") or []:
                device.pop("allowMultipleAllocations", None)
        return obj

    async def _watch(self, request: web.Request, resource: str, selector: dict[str, str]) -> web.StreamResponse:
        watcher = _Watcher(resource, selector, request.query.get("allowWatchBookmarks") == "true")
        since = request.query.get("resourceVersion", "")
        if since not in ("", "0") and int(since) < self._compacted:
            watcher.queue.put_nowait(
                {"type": "ERROR", "object": status(410, "Expired", f"too old resource version: {since}")}
            )
            watcher.queue.put_nowait(None)
        elif since in ("", "0"):
            store = {"resourceslices": self.slices, "pods": self.pods}.get(resource, self.nodes)
            for obj in store.values():
                if self._selected(obj, selector):
                    watcher.queue.put_nowait({"type": "ADDED", "object": copy.deepcopy(obj)})
        else:
            for rv, what, kind, obj in self._history:
                if what == resource and rv > int(since) and self._selected(obj, selector):
                    watcher.queue.put_nowait({"type": kind, "object": obj})
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        self._watchers.append(watcher)
        timeout = float(request.query.get("timeoutSeconds", "1800"))
        try:
            async with asyncio.timeout(timeout):
                while (event := await watcher.queue.get()) is not None:
                    await response.write(json.dumps(event).encode() + b"\n")
        except (TimeoutError, ConnectionResetError):  # the watch's end, or its client went (it closed the watch)
            pass
        finally:
            self._watchers.remove(watcher)
        with contextlib.suppress(ConnectionError):
            await response.write_eof()
        return response
