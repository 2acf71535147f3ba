"""A DRA driver (``rig``), or the whole daemon in DRA mode (``dra_node``), between a fake kubelet and a
fake API server, in a short temp dir (unix socket paths are limited to 107 bytes, which pytest's
tmp_path can exceed)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import yaml

from ate_devplugd.commands import manifests
from ate_devplugd.config import Config
from ate_devplugd.config.dra import DraConfig, Layout
from ate_devplugd.config.pools import DraResource
from ate_devplugd.dra import kubeconfig
from ate_devplugd.dra.driver import DraDriver, DraStatus
from ate_devplugd.dra.slices import SliceState
from ate_devplugd.node.kernel import KernelView
from tests.fakes.apiserver import FakeApiServer
from tests.fakes.certs import Pki
from tests.fakes.cri import FakeRuntime, containerd_info
from tests.fakes.dra_kubelet import WIPING_DELAY, FakeDraKubelet
from tests.support import DaemonInProcess, FakeMonitor, NotifyReceiver, daemon_in_process, kvm_config

NODE = "node-1"
TOKEN = "t0ken"
DRIVER = "kvm.ate.dev"
POOL = f"{NODE}/ate.dev/kvm"
KVM = DraResource("ate.dev/kvm", "ate.dev/kvm=kvm")


def write_kubeconfig(
    path: Path, server: str, *, token: str | None = TOKEN, pki: Pki | None = None, token_file: str | None = None
) -> Path:
    user: dict[str, str] = {}
    cluster: dict[str, str] = {"server": server}
    if token_file:
        user["tokenFile"] = token_file
    elif token:
        user["token"] = token
    if pki is not None:
        cluster["certificate-authority"] = str(pki.ca)
        user["client-certificate"] = str(pki.client_cert)
        user["client-key"] = str(pki.client_key)
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": cluster}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    path.write_text(json.dumps(doc))  # JSON is YAML
    return path


def write_token(path: Path, token: str, *, in_place: bool = False) -> None:
    """A token file written as a renewal writes it: to a new file renamed into place (or, ``in_place``,
    truncated and written)."""
    if in_place:
        path.write_text(token + "\n")
        return
    staging = path.with_name(f".{path.name}.new")
    staging.write_text(token + "\n")
    os.replace(staging, path)


class Records(logging.Handler):
    """Log records of the dra package, kept for the test to read."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self._logged = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self._logged.set()

    async def wait_events(self, name: str, count: int, timeout: float = 5.0) -> list[logging.LogRecord]:
        """The records of event ``name`` once there are ``count`` of them."""
        async with asyncio.timeout(timeout):
            while len(self.events(name)) < count:
                self._logged.clear()
                await self._logged.wait()
        return self.events(name)

    def events(self, name: str) -> list[logging.LogRecord]:
        return [r for r in self.records if getattr(r, "ATE_EVENT", None) == name]

    def at(self, level: int) -> list[logging.LogRecord]:
        return [r for r in self.records if r.levelno == level]


@dataclasses.dataclass
class Rig:
    dir: Path
    api: FakeApiServer
    kubelet: FakeDraKubelet
    config: DraConfig
    driver: DraDriver
    statuses: asyncio.Queue[DraStatus]
    log: Records
    #: The service account's token file (credentials="service-account"), which the kubeconfig names.
    token_file: Path | None = None

    async def status(self, pred: Callable[[DraStatus], bool], timeout: float = 5.0) -> DraStatus:
        """The driver's status once ``pred`` holds (checked now, then on each change)."""
        async with asyncio.timeout(timeout):
            current = self.driver.status()
            while not pred(current):
                current = await self.statuses.get()
            return current

    async def published(self) -> DraStatus:
        return await self.status(lambda s: s.slices is SliceState.PUBLISHED)

    def forget(self) -> None:
        """Drop the statuses reported so far: ``status()`` then sees only the current one and later ones."""
        while not self.statuses.empty():
            self.statuses.get_nowait()


@contextlib.asynccontextmanager
async def short_dir() -> AsyncIterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="dra-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.asynccontextmanager
async def rig(
    *,
    resources: tuple[DraResource, ...] = (KVM,),
    start_kubelet: bool = True,
    start_driver: bool = True,
    load_credentials: Callable[[str], kubeconfig.Credentials] = kubeconfig.load,
    api_options: dict[str, Any] | None = None,
    backoff: tuple[float, float] = (0.01, 0.2),
    credentials: str = "node",
    sharing: Layout | None = Layout.UNITS,
    **dra: Any,
) -> AsyncIterator[Rig]:
    """``credentials``: ``node`` (kubelet's, a static token here) or ``service-account`` (what
    ``dra-manifests`` prints, applied by an administrator, and a token bound to the Node in a file the
    kubeconfig names, as the renewal recipe of docs/dra.md writes it). ``sharing``: units unless told (None:
    the layout follows the fake API server, which keeps ``allowMultipleAllocations`` unless
    ``consumable_capacity`` is False)."""
    async with short_dir() as base:
        api = FakeApiServer(NODE, token=TOKEN)
        for key, value in (api_options or {}).items():
            setattr(api, key, value)
        await api.start()
        token_file = None
        if credentials == "service-account":
            admin = DraConfig(node_name=NODE, **{k: v for k, v in dra.items() if k == "driver"})
            text = manifests.render(admin, [r.name for r in resources])
            api.create(*(doc for doc in yaml.safe_load_all(text) if doc is not None))
            token_file = base / "token"
            write_token(token_file, api.mint_token())
        kc = write_kubeconfig(base / "kubeconfig", api.url, token_file=token_file and str(token_file))
        config = DraConfig(
            node_name=NODE, kubeconfig=str(kc), kubelet_dir=str(base / "kubelet"), sharing=sharing, **dra
        )
        statuses: asyncio.Queue[DraStatus] = asyncio.Queue()
        driver = DraDriver(
            config, resources, load_credentials=load_credentials, backoff=backoff, on_status=statuses.put_nowait
        )
        kubelet = FakeDraKubelet(base / "kubelet")
        records = Records()
        logger = logging.getLogger("ate_devplugd.dra")
        logger.addHandler(records)
        logger.setLevel(logging.DEBUG)
        try:
            if start_kubelet:
                await kubelet.start()
            if start_driver:
                await driver.start()
            yield Rig(base, api, kubelet, config, driver, statuses, records, token_file)
        finally:
            await driver.stop()
            await kubelet.stop()
            await api.stop()
            logger.removeHandler(records)


@dataclasses.dataclass
class DraNode:
    """The whole daemon in DRA mode, in process, between the fake API server and the fake DRA kubelet."""

    dir: Path
    api: FakeApiServer
    kubelet: FakeDraKubelet
    config: Config
    running: DaemonInProcess
    notify: NotifyReceiver

    async def status(self, text: str) -> str:
        """The daemon's STATUS= once it contains ``text``."""
        return (await self.notify.wait_for(lambda f: text in f.get("STATUS", "")))["STATUS"]

    def claim(self, name: str, device: str = "kvm-0") -> tuple[str, str, str]:
        uid = self.api.add_claim(
            "default", name, [{"request": "kvm", "driver": DRIVER, "pool": POOL, "device": device}]
        )
        return "default", uid, name


@contextlib.asynccontextmanager
async def dra_node(
    kernel: KernelView,
    dev_root: Path,
    monitor: FakeMonitor | None = None,
    reload_config: Callable[[], Config] | None = None,
    *,
    metrics_file: Path | str = "",
    wiping_delay: float = WIPING_DELAY,
    kubelet_process: bool = False,
    hold_health: bool = False,
    sharing: Layout | None = Layout.UNITS,
    runtime: bool = True,
) -> AsyncIterator[DraNode]:
    """A node in DRA mode: the API server first, the container runtime (a fake containerd that applies CDI
    and reads ``cdi_dir``: DRA's only path is CDI, and a device is offered only on its word; none with
    ``runtime=False``), then the daemon, then kubelet's plugin watcher (which wipes the driver's slices
    ``wiping_delay`` seconds after it deregistered, unless it came back). With ``kubelet_process``, kubelet
    also listens on kubelet.sock in the daemon's plugin directory from a process of its own; with
    ``hold_health`` it holds the driver's health stream (FakeDraKubelet)."""
    async with short_dir() as base:
        api = FakeApiServer(NODE, token=TOKEN)
        await api.start()
        kubeconfig = write_kubeconfig(base / "kubeconfig", api.url)
        dra = DraConfig(node_name=NODE, kubeconfig=str(kubeconfig), kubelet_dir=str(base / "kubelet"), sharing=sharing)
        plugin_dir = base / "device-plugins"
        plugin_dir.mkdir()
        config = dataclasses.replace(
            kvm_config(plugin_dir, dev_root, cdi=True, metrics_file=metrics_file), mode="dra", dra=dra
        )
        notify = NotifyReceiver(base / "notify")
        answer = containerd_info(True, [config.cdi_dir])
        cri = await FakeRuntime(Path(config.runtime_socket), "containerd", "2.1.9", answer).start() if runtime else None
        kubelet = FakeDraKubelet(
            base / "kubelet",
            on_wipe=api.wipe_driver,
            wiping_delay=wiping_delay,
            device_plugin_dir=plugin_dir if kubelet_process else None,
            hold_health=hold_health,
        )
        try:
            async with daemon_in_process(
                config, kernel, monitor=monitor, reload_config=reload_config, notify=notify.path
            ) as running:
                await kubelet.start()
                yield DraNode(base, api, kubelet, config, running, notify)
        finally:
            await kubelet.stop()
            await api.stop()
            await notify.close()
            if cri is not None:
                await cri.stop()
