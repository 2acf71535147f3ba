"""containerd of the test's own, driven as kubelet drives it: CRI ``runtime.v1`` over gRPC on a unix socket.

Which containerd (:func:`find_build`): a series ("1.6", "1.7", "2.1") is taken from the release's own
``/usr/bin/containerd`` (Debian 12: 1.6.20; Debian 13: 1.7.24), else from what ``make runtimes`` puts
in ``.cache/runtime/``: the Debian 13 tree of ``tests/runtime/run-suite.sh trixie`` (1.7.24) and the
unpacked .deb of ``tests/runtime/containerd-deb.sh`` (forky/sid's 2.1.9). Their containerd, shim and
ctr link only libc and run on Debian 12. The host's runc runs the containers (trixie's needs a newer
glibc).

One :class:`Containerd` has its own config, ``root``, ``state`` and socket under a work directory, and
runs in a private mount namespace under a subreaper (``subreaper.py``: a tmpfs on ``/run/containerd``,
where both series put their shim sockets whatever ``state`` says, and a parent that reaps the shims;
the one trace left on the host is that mount point, ``/run/containerd``, created empty if missing).
Its CRI plugin uses the ``native`` snapshotter (no overlay mount to outlive a run), runc with cgroupfs,
no CNI (pods use the node's network), a locally built static ``pause`` as the sandbox image, and
``restrict_oom_score_adj`` (these hosts' root lacks CAP_SYS_RESOURCE, so runc cannot lower a score).
``enable_cdi`` and ``cdi_spec_dirs`` are written only when given (1.6 knows neither key). The config is
a version 2 file (what 1.6 and 1.7 read, and 2.x migrates) or 2.x's own version 3 (:func:`config_toml`).

Images come from no registry: :func:`image_archive` writes a docker-archive of static files and
:meth:`Containerd.import_image` runs ``ctr -n k8s.io images import`` (CRI's namespace).

:class:`CriClient` is the CRI client (grpc.aio stubs of ``ate_devplugd._pb.cri.v1``), and
:func:`run_kvmcheck` does what kubelet does for one pod with one container that asks for a device:
RunPodSandbox (node network), CreateContainer (the Allocate answer's Devices and CDIDevices, a
``run_as_user``), StartContainer; it reads the checker's line from the container's CRI log and the OCI
spec from the bundle's ``config.json`` while the container runs, then stops and removes both;
:func:`run_allocated` does it with a device plugin's Allocate answer for a VMM that is not root.

Where containerd cannot run, :func:`require` skips, or fails with the reason when
``ATE_REQUIRE_CONTAINERD=1`` (``make check`` sets it). A series the release does not ship and no tree
provides for it (1.6 on Debian 13) always skips: there is nothing to require.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import fcntl
import hashlib
import io
import json
import os
import platform
import shutil
import signal
import struct
import subprocess
import sys
import tarfile
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import grpc
import pytest

from ate_devplugd._pb.cri.v1 import api_pb2 as cri
from ate_devplugd._pb.cri.v1 import api_pb2_grpc as cri_grpc
from tests.podman import CHECKER_SOURCE, KvmCheck

if TYPE_CHECKING:
    from tests.support import KvmAllocation
from tests.support import wait_for_path

#: Set to 1 where the tests must not skip for want of containerd (``make check``).
REQUIRE_ENV = "ATE_REQUIRE_CONTAINERD"
TOP = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
SUBREAPER = HERE / "subreaper.py"
PAUSE_SOURCE = HERE / "pause.c"
#: Where run-suite.sh keeps its Debian 13 tree and containerd-deb.sh its unpacked .deb (one per key, each
#: with ``root/usr/bin``; ``complete`` marks a finished build, ``<name>.lock`` beside it is its lock).
TREE_GLOB = ".cache/runtime/*/complete"
#: The shim directory both series hard-code (``defaults.DefaultStateDir`` + ``/s``).
SHIM_RUN_DIR = "/run/containerd"
NAMESPACE = "k8s.io"
PAUSE_IMAGE = "localhost/ate-pause:test"
CHECKER_IMAGE = "localhost/ate-kvmcheck:test"
START_TIMEOUT = 30.0
#: Each CRI call's deadline: generous, as a busy 2-core machine makes a first RunPodSandbox slow.
CALL_TIMEOUT = 60.0
#: The bundle directory of a container's task: ``<state>/io.containerd.runtime.v2.task/<namespace>/<id>``.
TASK_DIR = "io.containerd.runtime.v2.task"


class ContainerdUnavailable(Exception):
    """containerd cannot run here; the message says why."""


class ContainerdError(Exception):
    """containerd stopped or never answered; the message carries the end of its log."""


# -- which containerd --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ContainerdBuild:
    """A containerd, its runc shim and ctr, from one directory."""

    version: str  # as ``containerd --version`` gives it, e.g. "1.7.24~ds1"
    bin_dir: Path
    origin: str  # where it comes from, for messages: "/usr/bin" or the tree's path
    #: run-suite.sh's lock for a tree's build (held shared while the tree is in use), None for /usr/bin.
    lock_file: Path | None = None

    @property
    def series(self) -> str:
        """ "1.7" of "1.7.24~ds1"."""
        return ".".join(self.version.split(".")[:2])

    @property
    def containerd(self) -> Path:
        return self.bin_dir / "containerd"

    @property
    def shim(self) -> Path:
        return self.bin_dir / "containerd-shim-runc-v2"

    @property
    def ctr(self) -> Path:
        return self.bin_dir / "ctr"


def _version_of(bin_dir: Path) -> str | None:
    """``containerd github.com/containerd/containerd 1.6.20~ds1 1.6.20~ds1-1+deb12u3`` -> "1.6.20~ds1"."""
    binary = bin_dir / "containerd"
    if not os.access(binary, os.X_OK):
        return None
    try:
        done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30, check=False)
    except OSError:
        return None
    words = done.stdout.split()
    return words[2].removeprefix("v") if done.returncode == 0 and len(words) >= 3 else None


def release_build() -> ContainerdBuild | None:
    """The release's own containerd (``/usr/bin``), if installed."""
    version = _version_of(Path("/usr/bin"))
    return ContainerdBuild(version, Path("/usr/bin"), "/usr/bin") if version else None


def tree_builds() -> list[ContainerdBuild]:
    """The containerd of each finished tree under ``.cache/runtime`` (run-suite.sh's, containerd-deb.sh's)."""
    builds = []
    for marker in sorted(TOP.glob(TREE_GLOB)):
        bin_dir = marker.parent / "root" / "usr" / "bin"
        version = _version_of(bin_dir)
        if version:
            lock = marker.parent.parent / (marker.parent.name.split("-", 1)[0] + ".lock")
            builds.append(ContainerdBuild(version, bin_dir, str(marker.parent), lock))
    return builds


def find_build(series: str) -> ContainerdBuild | None:
    """A containerd of ``series`` ("1.6", "1.7", "2.1"): the release's own first, then a cached tree's."""
    for build in [b for b in [release_build()] if b] + tree_builds():
        if build.series == series:
            return build
    return None


def runc_path() -> str | None:
    """The host's runc (``/usr/sbin`` is not on every PATH)."""
    return shutil.which("runc", path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))


def unavailable_reason(series: str) -> str | None:
    """Why a containerd of ``series`` cannot run our containers here, or None."""
    if os.geteuid() != 0:
        return "the containerd tests need root (a containerd of their own, a private mount namespace)"
    missing = [tool for tool in ("unshare", "mount", "gcc") if not shutil.which(tool)]
    if runc_path() is None:
        missing.append("runc")
    if missing:
        return f"not installed: {', '.join(missing)} (apt-get install runc containerd gcc libc6-dev)"
    if not Path("/dev/kvm").exists():
        return "/dev/kvm does not exist (no kvm module)"
    if find_build(series) is None:
        return (
            f"no containerd {series}: neither /usr/bin/containerd (apt-get install containerd) nor a tree in "
            f"{TOP / '.cache/runtime'} has it (make runtimes: tests/runtime/run-suite.sh --build-only trixie "
            "brings 1.7, tests/runtime/containerd-deb.sh 2.1)"
        )
    return None


def require(series: str) -> ContainerdBuild:
    """The containerd of ``series``, or skip saying why; with ATE_REQUIRE_CONTAINERD=1, fail instead.

    Where the release ships another series and no tree offers this one (1.6 on Debian 13), skip even so.
    """
    if os.geteuid() == 0:
        own = release_build()
        if own is not None and own.series > series and find_build(series) is None:
            pytest.skip(f"containerd {series} is not offered here: this release ships containerd {own.version}")
    reason = unavailable_reason(series)
    if reason is None:
        build = find_build(series)
        assert build is not None
        return build
    _give_up(reason)


def require_images(workdir: Path) -> Images:
    """:meth:`Images.build`, or skip (fail with ATE_REQUIRE_CONTAINERD=1) where the static programs cannot
    be built."""
    try:
        return Images.build(workdir)
    except ContainerdUnavailable as exc:
        _give_up(str(exc))


def _give_up(reason: str) -> NoReturn:
    if os.environ.get(REQUIRE_ENV, "") not in ("", "0"):
        pytest.fail(f"containerd cannot run here ({REQUIRE_ENV} is set): {reason}", pytrace=False)
    pytest.skip(f"containerd cannot run here: {reason}")


# -- images --------------------------------------------------------------------------------------------


def build_static(source: Path, out: Path) -> Path:
    """``gcc -static`` ``source`` into ``out``; raises ContainerdUnavailable with gcc's words."""
    argv = ["gcc", "-static", "-O2", "-Wall", "-Werror", "-o", str(out), str(source)]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ContainerdUnavailable(f"cannot build {source.name}: {done.stderr.strip()[-500:]}")
    return out


def _oci_arch() -> str:
    machine = platform.machine()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


def image_archive(out: Path, ref: str, files: Mapping[str, Path], command: Sequence[str]) -> Path:
    """A docker-archive tar (what ``ctr images import`` reads) of one layer holding ``files``
    (image path -> host file, executable, root-owned) whose default command is ``command``."""
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, source in sorted(files.items()):
            info = tarfile.TarInfo(name.lstrip("/"))
            data = source.read_bytes()
            info.size, info.mode, info.uid, info.gid = len(data), 0o755, 0, 0
            tar.addfile(info, io.BytesIO(data))
    layer_bytes = layer.getvalue()
    diff_id = hashlib.sha256(layer_bytes).hexdigest()
    config = {
        "architecture": _oci_arch(),
        "os": "linux",
        "config": {"Cmd": list(command), "Env": ["PATH=/"], "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{diff_id}"]},
    }
    config_bytes = json.dumps(config, sort_keys=True).encode()
    config_name = hashlib.sha256(config_bytes).hexdigest() + ".json"
    manifest = [{"Config": config_name, "RepoTags": [ref], "Layers": [f"{diff_id}/layer.tar"]}]
    with tarfile.open(out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in (
            (f"{diff_id}/layer.tar", layer_bytes),
            (config_name, config_bytes),
            ("manifest.json", json.dumps(manifest).encode()),
        ):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return out


@dataclasses.dataclass(frozen=True)
class Images:
    """The two archives every containerd here imports: the sandbox's pause and the kvm checker."""

    pause: Path
    checker: Path

    @classmethod
    def build(cls, workdir: Path) -> Images:
        workdir.mkdir(parents=True, exist_ok=True)
        pause = build_static(PAUSE_SOURCE, workdir / "pause")
        checker = build_static(CHECKER_SOURCE, workdir / "kvmcheck")
        return cls(
            image_archive(workdir / "pause.tar", PAUSE_IMAGE, {"/pause": pause}, ["/pause"]),
            image_archive(workdir / "kvmcheck.tar", CHECKER_IMAGE, {"/kvmcheck": checker}, ["/kvmcheck"]),
        )


# -- the CRI client ------------------------------------------------------------------------------------


class CriClient:
    """CRI ``runtime.v1`` over one grpc.aio channel; remembers the pod sandboxes it ran, so that
    :meth:`remove_all` can take them down (containers go with their sandbox)."""

    def __init__(self, socket_path: Path | str) -> None:
        self.channel = grpc.aio.insecure_channel(f"unix:{socket_path}")
        self.runtime = cri_grpc.RuntimeServiceStub(self.channel)
        self.images = cri_grpc.ImageServiceStub(self.channel)
        self.sandboxes: set[str] = set()

    async def close(self) -> None:
        await self.channel.close()

    async def version(self, *, wait_for_ready: bool = False, timeout: float = CALL_TIMEOUT) -> cri.VersionResponse:
        response: cri.VersionResponse = await self.runtime.Version(
            cri.VersionRequest(version="v1"), timeout=timeout, wait_for_ready=wait_for_ready
        )
        return response

    async def status(self, *, verbose: bool = True) -> cri.StatusResponse:
        response: cri.StatusResponse = await self.runtime.Status(
            cri.StatusRequest(verbose=verbose), timeout=CALL_TIMEOUT
        )
        return response

    async def config(self) -> dict[str, Any]:
        """containerd's CRI config as its verbose Status gives it (``info["config"]``, JSON)."""
        return dict(json.loads((await self.status(verbose=True)).info["config"]))

    async def image_status(self, ref: str) -> cri.ImageStatusResponse:
        response: cri.ImageStatusResponse = await self.images.ImageStatus(
            cri.ImageStatusRequest(image=cri.ImageSpec(image=ref)), timeout=CALL_TIMEOUT
        )
        return response

    async def run_pod_sandbox(self, config: cri.PodSandboxConfig, runtime_handler: str = "") -> str:
        response = await self.runtime.RunPodSandbox(
            cri.RunPodSandboxRequest(config=config, runtime_handler=runtime_handler), timeout=CALL_TIMEOUT
        )
        self.sandboxes.add(response.pod_sandbox_id)
        return str(response.pod_sandbox_id)

    async def pod_sandbox_status(self, pod_id: str, *, verbose: bool = False) -> cri.PodSandboxStatusResponse:
        response: cri.PodSandboxStatusResponse = await self.runtime.PodSandboxStatus(
            cri.PodSandboxStatusRequest(pod_sandbox_id=pod_id, verbose=verbose), timeout=CALL_TIMEOUT
        )
        return response

    async def stop_pod_sandbox(self, pod_id: str) -> None:
        await self.runtime.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=pod_id), timeout=CALL_TIMEOUT)

    async def remove_pod_sandbox(self, pod_id: str) -> None:
        await self.runtime.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=pod_id), timeout=CALL_TIMEOUT)
        self.sandboxes.discard(pod_id)

    async def create_container(
        self, pod_id: str, config: cri.ContainerConfig, sandbox_config: cri.PodSandboxConfig
    ) -> str:
        response = await self.runtime.CreateContainer(
            cri.CreateContainerRequest(pod_sandbox_id=pod_id, config=config, sandbox_config=sandbox_config),
            timeout=CALL_TIMEOUT,
        )
        return str(response.container_id)

    async def start_container(self, container_id: str) -> None:
        await self.runtime.StartContainer(cri.StartContainerRequest(container_id=container_id), timeout=CALL_TIMEOUT)

    async def stop_container(self, container_id: str, timeout: int = 10) -> None:
        await self.runtime.StopContainer(
            cri.StopContainerRequest(container_id=container_id, timeout=timeout), timeout=CALL_TIMEOUT
        )

    async def remove_container(self, container_id: str) -> None:
        await self.runtime.RemoveContainer(cri.RemoveContainerRequest(container_id=container_id), timeout=CALL_TIMEOUT)

    async def container_status(self, container_id: str, *, verbose: bool = False) -> cri.ContainerStatusResponse:
        response: cri.ContainerStatusResponse = await self.runtime.ContainerStatus(
            cri.ContainerStatusRequest(container_id=container_id, verbose=verbose), timeout=CALL_TIMEOUT
        )
        return response

    async def list_containers(self, pod_id: str = "") -> list[cri.Container]:
        response = await self.runtime.ListContainers(
            cri.ListContainersRequest(filter=cri.ContainerFilter(pod_sandbox_id=pod_id)), timeout=CALL_TIMEOUT
        )
        return list(response.containers)

    async def remove_all(self) -> None:
        """Stop and remove every pod sandbox run through this client (as kubelet does when pods go)."""
        for pod_id in sorted(self.sandboxes):
            await self.stop_pod_sandbox(pod_id)
            await self.remove_pod_sandbox(pod_id)


# -- containerd ------------------------------------------------------------------------------------------


def config_toml(
    workdir: Path,
    *,
    runc: str,
    enable_cdi: bool | None = None,
    cdi_spec_dirs: Sequence[Path | str] | None = None,
    cri_extra: str = "",
    version: int = 2,
) -> str:
    """containerd's config for one run under ``workdir``: nothing outside it, no CNI, the native
    snapshotter, the host's runc, NRI's socket (NRI is on by default in 2.x) under ``workdir``.
    ``cri_extra`` adds raw lines to the table that holds ``enable_cdi``.

    ``version`` 2 is the layout 1.6 and 1.7 read (2.x migrates it when it starts): one CRI table,
    ``plugins."io.containerd.grpc.v1.cri"``. ``version`` 3 is 2.x's own: the runtime's keys (``enable_cdi``,
    ``cdi_spec_dirs``, runtimes, CNI) in ``plugins.'io.containerd.cri.v1.runtime'``, the images' in
    ``plugins.'io.containerd.cri.v1.images'``, and only the streaming server left in the old table.
    ``version`` 1 is a file without ``version``, whose plugin tables 1.x names by their short IDs
    (``plugins.cri``); for 1.x only (2.x reads none of its CRI keys, and NRI's table has no name there).
    """
    if version not in (1, 2, 3):
        raise ValueError(f"no containerd config version {version}")
    cri_lines = []
    if enable_cdi is not None:
        cri_lines.append(f"enable_cdi = {str(enable_cdi).lower()}")
    if cdi_spec_dirs is not None:
        cri_lines.append(f"cdi_spec_dirs = {json.dumps([str(d) for d in cdi_spec_dirs])}")
    cri_keys = "".join(f"  {line}{chr(10)}" for line in [*cri_lines, *cri_extra.splitlines()])
    header = "" if version == 1 else f"version = {version}\n"
    header += f"""\
root = "{workdir}/root"
state = "{workdir}/state"
disabled_plugins = [
  "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing",
]

[grpc]
  address = "{workdir}/containerd.sock"

[ttrpc]
  address = "{workdir}/containerd.sock.ttrpc"

[debug]
  address = ""

[metrics]
  address = ""

[{"plugins.opt" if version == 1 else 'plugins."io.containerd.internal.v1.opt"'}]
  path = "{workdir}/opt"
"""
    if version > 1:
        header += f"""
[plugins."io.containerd.nri.v1.nri"]
  socket_path = "{workdir}/nri.sock"
"""
    if version == 3:
        return header + _cri_v3(workdir, runc, cri_keys)
    cri_table = "plugins.cri" if version == 1 else 'plugins."io.containerd.grpc.v1.cri"'
    runtimes = f"{cri_table}.containerd.runtimes.runc"
    return f"""{header}
[{cri_table}]
  sandbox_image = "{PAUSE_IMAGE}"
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
{cri_keys}
[{cri_table}.cni]
  bin_dir = "{workdir}/cni/bin"
  conf_dir = "{workdir}/cni/conf"

[{cri_table}.containerd]
  snapshotter = "native"
  default_runtime_name = "runc"

[{runtimes}]
  runtime_type = "io.containerd.runc.v2"

[{runtimes}.options]
  BinaryName = "{runc}"
  SystemdCgroup = false
"""


def _cri_v3(workdir: Path, runc: str, runtime_keys: str) -> str:
    """The CRI part of a version 3 config (2.x)."""
    runtime_table = "plugins.'io.containerd.cri.v1.runtime'"
    runtimes = f"{runtime_table}.containerd.runtimes.runc"
    return f"""
[plugins.'io.containerd.cri.v1.images']
  snapshotter = "native"

[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = "{PAUSE_IMAGE}"

[{runtime_table}]
  restrict_oom_score_adj = true
{runtime_keys}
[{runtime_table}.cni]
  bin_dirs = ["{workdir}/cni/bin"]
  conf_dir = "{workdir}/cni/conf"

[{runtime_table}.containerd]
  default_runtime_name = "runc"

[{runtimes}]
  runtime_type = "io.containerd.runc.v2"
  snapshotter = "native"

[{runtimes}.options]
  BinaryName = "{runc}"
  SystemdCgroup = false

[plugins."io.containerd.grpc.v1.cri"]
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
"""


class Containerd:
    """One containerd with its own config, root, state and socket under ``workdir``; see the module doc.

    Start it with :meth:`start` (or :func:`running`), which waits until CRI answers and imports ``images``.
    """

    def __init__(self, build: ContainerdBuild, workdir: Path) -> None:
        self.build = build
        self.workdir = workdir
        self.config_path = workdir / "config.toml"
        self.socket = workdir / "containerd.sock"
        self.log_path = workdir / "containerd.log"
        self.state = workdir / "state"
        self.proc: asyncio.subprocess.Process | None = None
        self.client = CriClient(self.socket)
        #: The cgroup (in every hierarchy) that this containerd's pods go under, as kubelet's kubepods:
        #: one of its own, removed at :meth:`stop` (runc never removes the parents it makes).
        self.cgroup_root = f"/ate-cri-{uuid.uuid4().hex[:12]}"
        self._tree_lock: int | None = None

    def pod_cgroup(self, pod_uid: str) -> str:
        """A pod's cgroup parent under :attr:`cgroup_root` (cgroupfs driver: containers go beneath it)."""
        return f"{self.cgroup_root}/pod{pod_uid}"

    @classmethod
    async def start(
        cls,
        build: ContainerdBuild,
        workdir: Path,
        *,
        enable_cdi: bool | None = None,
        cdi_spec_dirs: Sequence[Path | str] | None = None,
        images: Sequence[Path] = (),
        cri_extra: str = "",
        config_version: int = 2,
        config_text: str | None = None,
    ) -> Containerd:
        """Write the config, start containerd, wait for CRI's Version to answer, import ``images``.

        ``config_text`` is written as the config instead of :func:`config_toml`'s (the file of an earlier
        start, edited): the content store under ``workdir`` keeps what was imported then.

        Raises ContainerdError, with the end of containerd's log, if it exits or does not answer.
        """
        runc = runc_path()
        if runc is None:
            raise ContainerdUnavailable("runc is not installed")
        workdir.mkdir(parents=True, exist_ok=True)
        self = cls(build, workdir)
        self._hold_tree()
        if config_text is None:
            config_text = config_toml(
                workdir,
                runc=runc,
                enable_cdi=enable_cdi,
                cdi_spec_dirs=cdi_spec_dirs,
                cri_extra=cri_extra,
                version=config_version,
            )
        self.config_path.write_text(config_text)
        try:
            await self._launch()
            for archive in images:
                await self.import_image(archive)
        except BaseException:
            await self.stop()
            raise
        return self

    def _hold_tree(self) -> None:
        """Take run-suite.sh's lock on a tree shared, as its own runs do, so that no rebuild removes the tree
        while this containerd runs from it."""
        if self.build.lock_file is None:
            return
        fd = os.open(self.build.lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ContainerdUnavailable(f"{self.build.origin} is being rebuilt (run-suite.sh holds its lock)") from None
        self._tree_lock = fd

    def _bin_dir(self) -> Path:
        """A directory holding only this build's shim, first on containerd's PATH (it looks the shim up there)."""
        bin_dir = self.workdir / "bin"
        bin_dir.mkdir(exist_ok=True)
        link = bin_dir / self.build.shim.name
        if not link.is_symlink():
            link.symlink_to(self.build.shim)
        return bin_dir

    async def _launch(self) -> None:
        os.makedirs(SHIM_RUN_DIR, mode=0o711, exist_ok=True)  # the mount point; the tmpfs is private
        path = os.pathsep.join([str(self._bin_dir()), os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
        argv = [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "--",
            sys.executable,
            str(SUBREAPER),
            "--tmpfs",
            SHIM_RUN_DIR,
            "--",
            str(self.build.containerd),
            "--config",
            str(self.config_path),
            "--log-level",
            "info",
        ]
        with open(self.log_path, "ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log, env={**os.environ, "PATH": path}
            )
        exited = asyncio.ensure_future(self.proc.wait())
        ready = asyncio.ensure_future(self._wait_ready())
        try:
            done, _ = await asyncio.wait({exited, ready}, timeout=START_TIMEOUT, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (exited, ready):
                if not task.done():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError, TimeoutError):
                        await task
        if ready in done and ready.exception() is None:
            return
        cause = "exited" if exited in done else f"did not answer CRI Version within {START_TIMEOUT:.0f} s"
        if ready in done and ready.exception() is not None:
            cause = f"did not answer CRI Version: {ready.exception()}"
        raise ContainerdError(f"containerd {self.build.version} {cause}: {self.log_tail()}")

    async def _wait_ready(self) -> None:
        """The socket, then CRI's Version answered. containerd serves its socket before its CRI service has
        initialized and answers "server is not initialized yet" (2.x: UNAVAILABLE) until it has; no event
        marks that moment, so such an answer is asked again after a short, doubling wait (as the daemon
        does), within the start's timeout."""
        await wait_for_path(self.socket, timeout=START_TIMEOUT)
        again = 0.02
        async with asyncio.timeout(START_TIMEOUT):
            while True:
                try:
                    await self.client.version(wait_for_ready=True, timeout=START_TIMEOUT)
                except grpc.aio.AioRpcError as exc:
                    if "not initialized" not in (exc.details() or ""):
                        raise
                else:
                    return
                await asyncio.sleep(again)
                again = min(again * 2, 0.5)

    async def import_image(self, archive: Path) -> str:
        """``ctr -n k8s.io images import`` an archive, unpacked for the CRI's snapshotter; ctr's output."""
        argv = [
            str(self.build.ctr),
            "--address",
            str(self.socket),
            "--namespace",
            NAMESPACE,
            "images",
            "import",
            "--snapshotter",
            "native",
            # 2.x's ctr imports through the transfer service, whose unpacker knows only the default
            # snapshotter (overlayfs, not loaded here): import in ctr itself, as 1.x always does.
            *(["--local"] if self.build.series >= "2" else []),
            str(archive),
        ]
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
        )
        async with asyncio.timeout(CALL_TIMEOUT):
            out, _ = await proc.communicate()
        text = out.decode(errors="replace")
        if proc.returncode != 0:
            raise ContainerdError(f"ctr images import {archive.name} exited {proc.returncode}: {text.strip()}")
        return text

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 15) -> str:
        return " | ".join(self.log().strip().splitlines()[-lines:]) or "(no output)"

    def bundle_spec(self, container_id: str) -> dict[str, Any]:
        """The OCI runtime spec runc was given for a running container: its bundle's ``config.json``."""
        path = self.state / TASK_DIR / NAMESPACE / container_id / "config.json"
        return dict(json.loads(path.read_text()))

    async def stop(self, timeout: float = START_TIMEOUT) -> int | None:
        """Remove the pods run through :attr:`client`, then stop containerd (SIGTERM; SIGKILL after
        ``timeout``); the subreaper kills and reaps whatever is left. Returns containerd's status."""
        try:
            if self.proc is None:
                return None
            if self.proc.returncode is None:
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await self.client.remove_all()
            await self.client.close()
            if self.proc.returncode is None:
                self.proc.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(timeout):
                    status = await self.proc.wait()
            except TimeoutError:
                self.proc.kill()
                status = await self.proc.wait()
            self._remove_cgroups()
            return status
        finally:
            if self._tree_lock is not None:
                os.close(self._tree_lock)
                self._tree_lock = None

    def _remove_cgroups(self) -> None:
        """rmdir :attr:`cgroup_root` and what is left beneath it, in every hierarchy (empty once the pods
        are gone; a cgroup still in use refuses, and stays)."""
        base = Path("/sys/fs/cgroup")
        hierarchies = [base, *(p for p in base.iterdir() if p.is_dir() and not p.is_symlink())]
        for hierarchy in hierarchies:
            top = hierarchy / self.cgroup_root.lstrip("/")
            if not top.is_dir():
                continue
            for directory in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                with contextlib.suppress(OSError):
                    directory.rmdir()
            with contextlib.suppress(OSError):
                top.rmdir()


@contextlib.asynccontextmanager
async def running(build: ContainerdBuild, workdir: Path, **options: Any) -> AsyncIterator[Containerd]:
    """:meth:`Containerd.start` for the block, stopped after it."""
    runtime = await Containerd.start(build, workdir, **options)
    try:
        yield runtime
    finally:
        await runtime.stop()


# -- one pod, as kubelet runs it -------------------------------------------------------------------------


def pod_config(name: str, log_directory: Path, *, uid: str = "", cgroup_parent: str = "") -> cri.PodSandboxConfig:
    """A pod sandbox on the node's network (no CNI), as kubelet asks for a hostNetwork pod: no hostname
    (kubelet sets one only for a pod with a network namespace of its own; runc refuses to set it in the
    node's UTS namespace)."""
    return cri.PodSandboxConfig(
        metadata=cri.PodSandboxMetadata(name=name, uid=uid or str(uuid.uuid4()), namespace="default", attempt=0),
        log_directory=str(log_directory),
        linux=cri.LinuxPodSandboxConfig(
            cgroup_parent=cgroup_parent,
            security_context=cri.LinuxSandboxSecurityContext(
                namespace_options=cri.NamespaceOption(
                    network=cri.NamespaceMode.NODE, pid=cri.NamespaceMode.CONTAINER, ipc=cri.NamespaceMode.POD
                )
            ),
        ),
    )


@dataclasses.dataclass(frozen=True)
class CriLogLine:
    """One line of a container's log in the CRI format: ``<RFC 3339 time> <stream> <P|F> <text>``."""

    time: str
    stream: str
    partial: bool
    text: str

    @classmethod
    def parse(cls, line: str) -> CriLogLine:
        stamp, stream, tag, text = line.split(" ", 3)
        return cls(stamp, stream, tag == "P", text)


_IN_MODIFY = 0x2
_IN_CREATE = 0x100
_IN_MOVED_TO = 0x80
_INOTIFY_EVENT = struct.Struct("iIII")


async def wait_for_log_line(path: Path, stream: str = "stdout", timeout: float = CALL_TIMEOUT) -> CriLogLine:
    """The first full line on ``stream`` in a container's CRI log, waiting on inotify (the runtime appends
    to the file; its directory is watched for the file's creation and every write)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    if fd < 0:
        raise OSError(ctypes.get_errno(), "inotify_init1")
    changed = asyncio.Event()
    loop = asyncio.get_running_loop()

    def drain() -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(fd, 65536):
                pass
        changed.set()

    try:
        if libc.inotify_add_watch(fd, str(path.parent).encode(), _IN_MODIFY | _IN_CREATE | _IN_MOVED_TO) < 0:
            raise OSError(ctypes.get_errno(), f"inotify_add_watch {path.parent}")
        loop.add_reader(fd, drain)
        async with asyncio.timeout(timeout):
            while True:
                changed.clear()
                with contextlib.suppress(FileNotFoundError):
                    for raw in path.read_text(errors="replace").splitlines():
                        line = CriLogLine.parse(raw)
                        if line.stream == stream and not line.partial:
                            return line
                await changed.wait()
    finally:
        loop.remove_reader(fd)
        os.close(fd)


@dataclasses.dataclass
class CheckerRun:
    """What one kubelet-like pod with the kvm checker came to: where it stopped, what the checker saw,
    the OCI spec's device entries, and how long each CRI step took (ms)."""

    runtime: str  # "containerd 1.7.24~ds1"
    failed_call: str | None = None  # the CRI call that failed ("CreateContainer", ...), None: it ran
    error: str = ""  # that call's gRPC status details
    check: KvmCheck | None = None
    oci_devices: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # spec.linux.devices
    oci_device_rules: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # linux.resources.devices
    container_user: dict[str, Any] = dataclasses.field(default_factory=dict)  # spec.process.user
    timings_ms: dict[str, float] = dataclasses.field(default_factory=dict)

    def summary(self) -> str:
        """One line for a test's output: the figures and what the container saw."""
        steps = ", ".join(f"{name} {ms:.0f} ms" for name, ms in self.timings_ms.items())
        if self.check is None:
            outcome = f"{self.failed_call} failed: {self.error}"
        elif self.check.guest is not None:
            outcome = f"guest wrote {self.check.guest.output!r}, exit {self.check.guest.exit_reason}"
        else:
            outcome = f"open {self.check.open_error}"
        nodes = [
            f"{d.get('path')} {d.get('type')} {d.get('major')}:{d.get('minor')} "
            f"mode {d.get('fileMode', 0):#o} {d.get('uid')}:{d.get('gid')}"
            for d in self.oci_devices
        ]
        rules = [
            f"{'allow' if r.get('allow') else 'deny'} {r.get('type', 'a')} "
            f"{_num(r.get('major'))}:{_num(r.get('minor'))} {r.get('access')}"
            for r in self.oci_device_rules
        ]
        return f"{self.runtime}: {steps}; {outcome}; OCI linux.devices {nodes}; allow rules {rules}"


def _num(value: object) -> str:
    """A device number of an OCI rule; absent means any (``*``)."""
    return "*" if value is None else str(value)


def _ms(since: float) -> float:
    return (time.monotonic() - since) * 1000


#: The VMM's user: the pod's runAsUser and runAsGroup.
VMM_USER = (1000, 1000)


async def run_allocated(runtime: Containerd, allocation: KvmAllocation) -> CheckerRun:
    """The checker run as VMM_USER, as kubelet runs a container with the plugin's Allocate answer: its
    DeviceSpecs as the CRI Devices and its CDI names as the CDIDevices (``kuberuntime_container.go``:
    makeDevices, makeCDIDevices)."""
    devices = [
        cri.Device(container_path=d.container_path, host_path=d.host_path, permissions=d.permissions)
        for d in allocation.device_specs
    ]
    return await run_kvmcheck(
        runtime, devices=devices, cdi_devices=allocation.cdi_names, run_as_user=VMM_USER[0], run_as_group=VMM_USER[1]
    )


async def run_kvmcheck(
    runtime: Containerd,
    *,
    devices: Sequence[cri.Device] = (),
    cdi_devices: Sequence[str] = (),
    run_as_user: int | None = VMM_USER[0],
    run_as_group: int | None = VMM_USER[1],
    name: str = "vmm",
) -> CheckerRun:
    """One pod with one container running the kvm checker (``/kvmcheck --hold``), created as kubelet
    creates it: RunPodSandbox on the node's network, CreateContainer with ``devices`` (kubelet's Devices
    from the DeviceSpecs) and ``cdi_devices`` (its CDIDevices) and ``run_as_user``/``run_as_group`` (a pod's
    runAsUser/runAsGroup; the image has no /etc/passwd or /etc/group), StartContainer. The
    checker's line is read from the CRI log and the OCI spec from the bundle while the container runs;
    then the container and the pod are stopped and removed. A failed CRI call ends the run there."""
    result = CheckerRun(runtime=f"containerd {runtime.build.version}")
    client = runtime.client
    logs = runtime.workdir / "pods" / f"{name}-{uuid.uuid4().hex[:8]}"
    (logs / name).mkdir(parents=True)  # kubelet makes the container's log directory
    pod_uid = str(uuid.uuid4())
    sandbox = pod_config(f"{name}-pod", logs, uid=pod_uid, cgroup_parent=runtime.pod_cgroup(pod_uid))
    security = cri.LinuxContainerSecurityContext()
    if run_as_user is not None:
        security.run_as_user.value = run_as_user
    if run_as_group is not None:
        security.run_as_group.value = run_as_group
    container = cri.ContainerConfig(
        metadata=cri.ContainerMetadata(name=name, attempt=0),
        image=cri.ImageSpec(image=CHECKER_IMAGE),
        command=["/kvmcheck", "--hold"],
        devices=list(devices),
        cdi_devices=[cri.CDIDevice(name=n) for n in cdi_devices],
        log_path=f"{name}/0.log",
        linux=cri.LinuxContainerConfig(security_context=security),
    )
    step = "RunPodSandbox"
    pod_id = container_id = ""
    try:
        began = time.monotonic()
        pod_id = await client.run_pod_sandbox(sandbox)
        result.timings_ms["RunPodSandbox"] = _ms(began)
        step, began = "CreateContainer", time.monotonic()
        container_id = await client.create_container(pod_id, container, sandbox)
        result.timings_ms["CreateContainer"] = _ms(began)
        step, began = "StartContainer", time.monotonic()
        await client.start_container(container_id)
        result.timings_ms["StartContainer"] = _ms(began)
        line = await wait_for_log_line(logs / name / "0.log")
        result.timings_ms["start to checker line"] = _ms(began)
        result.check = KvmCheck.parse(line.text)
        spec = runtime.bundle_spec(container_id)
        result.oci_devices = list(spec.get("linux", {}).get("devices") or [])
        result.oci_device_rules = list(spec.get("linux", {}).get("resources", {}).get("devices") or [])
        result.container_user = dict(spec.get("process", {}).get("user") or {})
        step = "StopContainer"
        await client.stop_container(container_id)
    except grpc.aio.AioRpcError as exc:
        result.failed_call, result.error = step, exc.details() or str(exc.code())
    finally:
        if pod_id:
            await client.stop_pod_sandbox(pod_id)
            await client.remove_pod_sandbox(pod_id)
    return result


def oci_node(run: CheckerRun, path: str) -> list[dict[str, Any]]:
    """The OCI spec's ``linux.devices`` entries for ``path``."""
    return [d for d in run.oci_devices if d.get("path") == path]


def oci_rules(run: CheckerRun, major: int, minor: int) -> list[str]:
    """The OCI spec's allow rules for char ``major:minor``, as ``"rw"``-style access strings."""
    return [
        str(r.get("access", ""))
        for r in run.oci_device_rules
        if r.get("allow") and r.get("type") == "c" and (r.get("major"), r.get("minor")) == (major, minor)
    ]
