#!/usr/bin/python3
"""The node's control plane for switch-mode in the booted container: what the package test runs as a unit
of its own (systemd-run), beside the fake kubelet's device manager (the fake-kubelet unit).

    control_plane.py serve --node NAME --kubeconfig PATH --kubelet-dir DIR --kubelet-log KLOG --log LOG
    control_plane.py state --node NAME --kubeconfig PATH [--driver DRIVER]
    control_plane.py cordoned --log LOG --after T
    control_plane.py apply --kubeconfig PATH < manifests.yaml
    control_plane.py pod NAME [--delete]

serve runs, until SIGTERM:
- the fake API server (tests/fakes/apiserver.py) on 127.0.0.1 (plain HTTP, kubelet's token), with the Node
  NAME, and writes the kubeconfig that reaches it (kubelet's credential: what switch-mode and the daemon
  use by default);
- kubelet's DRA plugin watcher on DIR/plugins_registry (tests/fakes/dra_kubelet.py), which wipes a
  driver's slices 30 s after it went, as kubelet does;
- kubelet's node-status update: every PERIOD the Node's allocatable and capacity are set to what the
  fake kubelet's device manager last said in KLOG (a ListAndWatch's healthy and total units; 0 healthy once
  its stream ended, it disconnected, restarted or stopped), when that changed, with kubelet's version
  (VERSION) in ``status.nodeInfo``;
- an administrator's credential (ADMIN_TOKEN), which ``apply`` uses to create what ``dra-manifests`` prints;
- on 127.0.0.1:CONTROL_PORT, the pods bound to the node as the test puts them there: ``pod NAME`` adds a
  Running pod that took the DRA path for ate.dev/kvm (its claim made by the scheduler), ``--delete`` removes
  it (as kubelet's unprepare and deletion would).
What it sees goes to LOG as JSON lines ("t", "event", ...), for wait_event.py: "listening" once it serves,
"node" (spec.unschedulable and the annotations, when they change), "node-status", "slice-added",
"slice-modified", "slice-deleted" (name, driver, devices), "dra-registered", "dra-deregistered" and
the plugin watcher's other events.

state prints the Node and this node's slices as switch-mode's checks read them, one "key value" a line:
"unschedulable false", "annotations {}", "allocatable ate.dev/kvm 4096", "slices 1", "slice NAME 128".
cordoned prints how long the Node was cordoned (seconds: its first cordon in LOG after T to the uncordon).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

# The share's tests.fakes, beside this file (and the project's package on PYTHONPATH, for the DRA kubelet).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from aiohttp import web

from tests.fakes.apiserver import NODES, SLICES, FakeApiServer
from tests.fakes.dra_kubelet import FakeDraKubelet

PORT = 6443
CONTROL_PORT = 6444
TOKEN = "pkgtest-kubelet-token"
ADMIN_TOKEN = "pkgtest-admin-token"
#: The kubelet the Node says it runs (DRAExtendedResource on by default).
VERSION = "v1.36.2"
#: kubelet's node-status update period here (nodeStatusUpdateFrequency, 10 s by default on a node).
PERIOD = 1.0
#: The fake kubelet's events after which its device manager offers none of the resource's units.
GONE = ("register", "stream-ended", "disconnected")


class Log:
    def __init__(self, path: str) -> None:
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open while serving

    def __call__(self, event: str, **fields: Any) -> None:
        self._file.write(json.dumps({"t": time.time(), "event": event, **fields}) + "\n")
        self._file.flush()


def write_kubeconfig(path: str, server: str) -> None:
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "local", "cluster": {"server": server}}],
        "users": [{"name": "kubelet", "user": {"token": TOKEN}}],
        "contexts": [{"name": "kubelet", "context": {"cluster": "local", "user": "kubelet"}}],
        "current-context": "kubelet",
    }
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f)  # JSON is YAML


class StatusReporter:
    """Follows the fake kubelet's log; reports its device manager's units on the Node every PERIOD."""

    def __init__(self, api: FakeApiServer, kubelet_log: str, log: Log) -> None:
        self._api, self._path, self._log = api, kubelet_log, log
        self._offset = 0
        self._units: dict[str, tuple[int, int]] = {}  # resource -> (healthy, total)
        self._reported: dict[str, tuple[int, int]] = {}

    def _read(self) -> None:
        try:
            with open(self._path, encoding="utf-8") as f:
                f.seek(self._offset)
                for line in f:
                    if not line.endswith("\n"):
                        break  # a record still being written
                    self._offset += len(line.encode())
                    self._take(json.loads(line))
        except FileNotFoundError:
            pass

    def _take(self, record: dict[str, Any]) -> None:
        event, resource = record.get("event"), record.get("resource", "")
        total = self._units.get(resource, (0, 0))[1]
        if event == "list":
            self._units[resource] = (int(record["healthy"]), int(record["total"]))
        elif event in GONE and resource:
            self._units[resource] = (0, total)
        elif event in ("restart", "stopped"):
            self._units = {name: (0, units[1]) for name, units in self._units.items()}

    def report(self) -> None:
        self._read()
        if self._units != self._reported:
            allocatable = {name: str(units[0]) for name, units in self._units.items()}
            capacity = {name: str(units[1]) for name, units in self._units.items()}
            self._api.set_node_status(allocatable, capacity, kubelet_version=VERSION)
            self._reported = dict(self._units)
            self._log("node-status", allocatable=allocatable, capacity=capacity)

    async def run(self) -> None:
        while True:
            self.report()
            await asyncio.sleep(PERIOD)


async def serve(args: argparse.Namespace) -> int:
    log = Log(args.log)
    api = FakeApiServer(args.node, token=TOKEN, admin_token=ADMIN_TOKEN)
    seen: dict[str, Any] = {}

    def node_changed(resource: str) -> None:
        if resource != "nodes" or args.node not in api.nodes:
            return
        node = api.nodes[args.node]
        now = {
            "unschedulable": bool((node.get("spec") or {}).get("unschedulable")),
            "annotations": node["metadata"].get("annotations") or {},
        }
        if now != seen:
            seen.update(now)
            log("node", **now)

    api.listeners.append(node_changed)
    await api.start(args.port)
    write_kubeconfig(args.kubeconfig, api.url)
    dra = FakeDraKubelet(Path(args.kubelet_dir), on_wipe=api.wipe_driver)
    await dra.start()
    reporter = StatusReporter(api, args.kubelet_log, log)

    async def slices() -> None:
        while True:
            kind, obj = await api.changes.get()
            spec = obj.get("spec") or {}
            devices = len(spec.get("devices") or [])
            log(f"slice-{kind.lower()}", name=obj["metadata"]["name"], driver=spec.get("driver"), devices=devices)

    async def plugin_watcher() -> None:
        while True:
            ev = await dra.events.get()
            log(f"dra-{ev.kind}", driver=ev.name, detail=ev.detail)

    control = await serve_pods(api, args.node, log)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks = [loop.create_task(c) for c in (reporter.run(), slices(), plugin_watcher())]
    log("listening", url=api.url, node=args.node)
    await stop.wait()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await control.cleanup()
    await dra.stop()
    await api.stop()
    log("stopped")
    return 0


def dra_pod(name: str, node: str) -> dict[str, Any]:
    """A pod bound to ``node`` that asked ate.dev/kvm and took the DRA path, Running."""
    container = {"name": "vm", "resources": {"limits": {"ate.dev/kvm": "1"}, "requests": {"ate.dev/kvm": "1"}}}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"namespace": "default", "name": name},
        "spec": {"nodeName": node, "containers": [container]},
        "status": {"phase": "Running", "extendedResourceClaimStatus": {"resourceClaimName": name + "-claim"}},
    }


async def serve_pods(api: FakeApiServer, node: str, log: Log) -> web.AppRunner:
    """POST or DELETE /pods/NAME on 127.0.0.1:CONTROL_PORT: a DRA pod bound here, or its removal."""

    async def handle(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if request.method == "DELETE":
            api.remove_pod("default", name)
        else:
            api.put_pod(dra_pod(name, node))
        log("pod", name=name, method=request.method)
        return web.Response(text="ok\n")

    app = web.Application()
    app.router.add_route("*", "/pods/{name}", handle)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", CONTROL_PORT).start()
    return runner


def apply(kubeconfig_path: str) -> int:
    """The YAML documents on stdin created with the administrator's credential (as ``kubectl apply``)."""
    import yaml

    with open(kubeconfig_path, encoding="utf-8") as f:
        server = json.load(f)["clusters"][0]["cluster"]["server"]
    collections = {
        "DeviceClass": "/apis/resource.k8s.io/v1/deviceclasses",
        "ClusterRole": "/apis/rbac.authorization.k8s.io/v1/clusterroles",
        "ClusterRoleBinding": "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
    }
    for doc in yaml.safe_load_all(sys.stdin):
        if not doc:
            continue
        request = urllib.request.Request(
            server + collections[doc["kind"]],
            data=json.dumps(doc).encode(),
            method="POST",
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10):
            print(f"{doc['kind'].lower()}/{doc['metadata']['name']} created")
    return 0


def pod(args: argparse.Namespace) -> int:
    method = "DELETE" if args.delete else "POST"
    request = urllib.request.Request(f"http://127.0.0.1:{CONTROL_PORT}/pods/{args.name}", data=b"", method=method)
    with urllib.request.urlopen(request, timeout=10):
        return 0


def get(kubeconfig: dict[str, Any], path: str) -> dict[str, Any]:
    server = kubeconfig["clusters"][0]["cluster"]["server"]
    token = kubeconfig["users"][0]["user"]["token"]
    request = urllib.request.Request(server + path, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        doc: dict[str, Any] = json.load(answer)
        return doc


def state(args: argparse.Namespace) -> int:
    with open(args.kubeconfig, encoding="utf-8") as f:
        kubeconfig = json.load(f)
    name = args.node
    node = get(kubeconfig, f"{NODES}/{name}")
    print("unschedulable", json.dumps(bool((node.get("spec") or {}).get("unschedulable"))))
    print("annotations", json.dumps(node["metadata"].get("annotations") or {}, sort_keys=True))
    for resource, value in sorted(((node.get("status") or {}).get("allocatable") or {}).items()):
        print("allocatable", resource, value)
    query = urllib.parse.urlencode({"fieldSelector": f"spec.nodeName={name},spec.driver={args.driver}"})
    items = get(kubeconfig, f"{SLICES}?{query}").get("items") or []
    print("slices", len(items))
    for item in items:
        print("slice", item["metadata"]["name"], len(item["spec"].get("devices") or []))
    return 0


def cordoned(args: argparse.Namespace) -> int:
    with open(args.log, encoding="utf-8") as f:
        records = [r for r in map(json.loads, f) if r["t"] > args.after and r["event"] == "node"]
    down = next((r["t"] for r in records if r["unschedulable"]), None)
    up = next((r["t"] for r in records if down is not None and r["t"] > down and not r["unschedulable"]), None)
    if down is None or up is None:
        print("the Node was not cordoned and uncordoned", file=sys.stderr)
        return 1
    print(f"{up - down:.1f}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("serve")
    run.add_argument("--node", required=True)
    run.add_argument("--kubeconfig", required=True, help="written here")
    run.add_argument("--kubelet-dir", required=True)
    run.add_argument("--kubelet-log", required=True, help="the fake kubelet's JSON-lines log")
    run.add_argument("--log", required=True)
    run.add_argument("--port", type=int, default=PORT)
    show = sub.add_parser("state")
    show.add_argument("--node", required=True)
    show.add_argument("--kubeconfig", required=True)
    show.add_argument("--driver", default="kvm.ate.dev")
    window = sub.add_parser("cordoned")
    window.add_argument("--log", required=True)
    window.add_argument("--after", type=float, default=0.0)
    applying = sub.add_parser("apply")
    applying.add_argument("--kubeconfig", required=True, help="where serve wrote it (the server's address)")
    pods = sub.add_parser("pod")
    pods.add_argument("name")
    pods.add_argument("--delete", action="store_true")
    args = parser.parse_args()
    if args.command == "serve":
        return asyncio.run(serve(args))
    if args.command == "apply":
        return apply(args.kubeconfig)
    if args.command == "pod":
        return pod(args)
    return cordoned(args) if args.command == "cordoned" else state(args)


if __name__ == "__main__":
    sys.exit(main())
