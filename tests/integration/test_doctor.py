"""``ate-devplugd doctor`` on a node made of real parts in a temp directory: the daemon on the test's loop
with the fake kernel, the fake kubelet, a fake runtime answering CRI on a unix socket, a stand-in
kubelet binary. No root needed."""

from __future__ import annotations

import dataclasses
import errno
import grp
import json
import os
import pwd
from pathlib import Path

import pytest
import yaml

from ate_devplugd import cli
from ate_devplugd.commands import manifests
from ate_devplugd.commands.doctor import Node, examine
from ate_devplugd.commands.findings import Finding, Level, failed, render_json
from ate_devplugd.commands.findings import render as render_text
from ate_devplugd.config import Config, render
from ate_devplugd.config.device import DeviceConfig
from ate_devplugd.config.dra import DraConfig, Layout
from ate_devplugd.config.pools import DraResource, build_pools, slice_spec
from ate_devplugd.deviceplugin import drops
from tests.fakes.apiserver import FakeApiServer
from tests.fakes.cri import FakeRuntime, containerd_info
from tests.integration.dra_rig import NODE, TOKEN, write_kubeconfig
from tests.support import FakeKernel, daemon_in_process, kvm_config, record_of, started_kubelet, wait_for_content


def node_config(tmp_path: Path, plugin_dir: Path, fake_root: Path, **top: str) -> tuple[Config, Path]:
    """A CDI kvm resource with metrics on; the config also written to a file (doctor reads a file)."""
    prom = tmp_path / "metrics" / "ate-devplugd.prom"
    prom.parent.mkdir(exist_ok=True)
    config = dataclasses.replace(
        kvm_config(plugin_dir, fake_root, metrics_file=prom, cdi=True, container_mode=0o666),
        **{"runtime_socket": str(tmp_path / "runtime.sock"), **top},
    )
    path = tmp_path / "config.toml"
    path.write_text(render(config))
    return config, path


def kubelet_binary(tmp_path: Path, version: str) -> Path:
    """A stand-in for the kubelet binary: ``--version`` prints what kubelet 1.x prints."""
    script = tmp_path / "kubelet"
    script.write_text(f"#!/bin/sh\necho 'Kubernetes {version}'\n")
    script.chmod(0o755)
    return script


def host_node(fake_root: Path, mode: int = 0o660) -> None:
    """The host's /dev/kvm as doctor stats it (the fake kernel's table gives its numbers)."""
    node = fake_root / "dev" / "kvm"
    node.write_text("")
    node.chmod(mode)


def by_check(findings: list[Finding]) -> dict[str, Finding]:
    return {f.check: f for f in findings}


class TestAllRight:
    async def test_only_ok_lines(self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel) -> None:
        """Daemon registered, kubelet 1.31, containerd 1.7 applying CDI from our directory: every line OK."""
        config, path = node_config(tmp_path, plugin_dir, fake_root)
        host_node(fake_root)
        info = containerd_info(True, ["/etc/cdi", config.cdi_dir])
        runtime = await FakeRuntime(tmp_path / "runtime.sock", "containerd", "1.7.24~ds1", info).start()
        kubelet = await started_kubelet(plugin_dir)
        binary = kubelet_binary(tmp_path, "v1.31.2")
        try:
            async with daemon_in_process(config, kernel):
                await kubelet.next_event("list")
                findings = await examine(path, Node(kernel=kernel, find_kubelet=lambda: str(binary)))
        finally:
            await kubelet.stop()
            await runtime.stop()
        text = render_text(findings)
        assert {f.level for f in findings} == {Level.OK}, text
        assert not failed(findings)
        checks = by_check(findings)
        assert list(checks) == [
            "config",
            "device ate.dev/kvm",
            "kvm ate.dev/kvm",
            "access ate.dev/kvm",
            "daemon",
            "socket ate.dev/kvm",
            "registered ate.dev/kvm",
            "kubelet",
            "kubelet version",
            "cgroup",
            "runtime",
            "runtime cdi",
            "cdi specs",
            "switch-mode",
        ]
        assert checks["device ate.dev/kvm"].message == "/dev/kvm: character device 10:232"
        assert checks["access ate.dev/kvm"].message.startswith("host 0660 ")
        assert "containers get 0666 (owned by the container's user) through CDI" in checks["access ate.dev/kvm"].message
        assert checks["daemon"].message.startswith(f"running (pid {os.getpid()}, device-plugin mode in {plugin_dir}, ")
        assert checks["registered ate.dev/kvm"].message == "kubelet offers 4096 units of it (its pod-resources API)"
        assert (
            checks["runtime"].message
            == f"containerd 1.7.24~ds1 at {tmp_path / 'runtime.sock'} (runtime_socket in our config)"
        )
        assert checks["runtime cdi"].message == f"containerd 1.7.24~ds1 applies CDI (reads {config.cdi_dir})"
        assert checks["kubelet version"].message == "v1.31.2: passes CDI names to the runtime"
        assert all(line.startswith("OK    ") for line in text.splitlines())


#: The cgroup v2 mount as /proc/self/mountinfo shows it.
CGROUP2_MOUNTINFO = "30 1 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw\n"
#: A typical run's findings (check, level, message, remedy): the daemon registered, kubelet 1.31, containerd
#: 1.7 with enable_cdi = false. ``{tmp}``, ``{pid}``, ``{owner}`` and ``{gid}`` stand for the run's own.
TYPICAL = [
    ("config", "OK", "the running daemon's, {tmp}/config.toml: 1 device(s), device-plugin mode", ""),
    ("device ate.dev/kvm", "OK", "/dev/kvm: character device 10:232", ""),
    ("kvm ate.dev/kvm", "OK", "KVM API 12; KVM_CREATE_VM works", ""),
    (
        "access ate.dev/kvm",
        "WARN",
        "host 0660 {owner}: a VMM that is not root (nor in the node's gid {gid}) gets EACCES: the runtime does not "
        "apply its CDI spec (see runtime)",
        'fix the runtime line below, and set cdi = "required" so that it is not offered meanwhile',
    ),
    ("daemon", "OK", "running ({daemon})", ""),
    ("socket ate.dev/kvm", "OK", "answers: 4096/4096 healthy, Allocate grants /dev/kvm -> /dev/kvm (rw)", ""),
    ("registered ate.dev/kvm", "OK", "kubelet offers 4096 units of it (its pod-resources API)", ""),
    ("kubelet", "OK", "{tmp}/device-plugins/kubelet.sock answers", ""),
    ("kubelet version", "OK", "v1.31.2: passes CDI names to the runtime", ""),
    ("cgroup", "OK", "v2: the runtime grants the device with an eBPF device program", ""),
    ("runtime", "OK", "containerd 1.7.24 at {tmp}/runtime.sock (runtime_socket in our config)", ""),
    (
        "runtime cdi",
        "FAIL",
        "containerd 1.7.24 ignores CDI (enable_cdi = false): containers get the host's node (owner and mode), so "
        "a non-root VMM gets EACCES",
        'set enable_cdi = true in [plugins."io.containerd.grpc.v1.cri"] of /etc/containerd/config.toml, restart '
        "containerd, then kubelet",
    ),
    ("cdi specs", "OK", "no other spec in {tmp}/cdi defines ate.dev/kvm=kvm", ""),
    ("switch-mode", "OK", "no move under way: the file and the running daemon are in device-plugin mode", ""),
]
TYPICAL_TEXT = """\
OK    config                  the running daemon's, {tmp}/config.toml: 1 device(s), device-plugin mode
OK    device ate.dev/kvm      /dev/kvm: character device 10:232
OK    kvm ate.dev/kvm         KVM API 12; KVM_CREATE_VM works
WARN  access ate.dev/kvm      host 0660 {owner}: a VMM that is not root (nor in the node's gid {gid}) gets EACCES: \
the runtime does not apply its CDI spec (see runtime) -- fix the runtime line below, and set cdi = "required" \
so that it is not offered meanwhile
OK    daemon                  running ({daemon})
OK    socket ate.dev/kvm      answers: 4096/4096 healthy, Allocate grants /dev/kvm -> /dev/kvm (rw)
OK    registered ate.dev/kvm  kubelet offers 4096 units of it (its pod-resources API)
OK    kubelet                 {tmp}/device-plugins/kubelet.sock answers
OK    kubelet version         v1.31.2: passes CDI names to the runtime
OK    cgroup                  v2: the runtime grants the device with an eBPF device program
OK    runtime                 containerd 1.7.24 at {tmp}/runtime.sock (runtime_socket in our config)
FAIL  runtime cdi             containerd 1.7.24 ignores CDI (enable_cdi = false): containers get the host's node \
(owner and mode), so a non-root VMM gets EACCES -- set enable_cdi = true in [plugins."io.containerd.grpc.v1.cri"] \
of /etc/containerd/config.toml, restart containerd, then kubelet
OK    cdi specs               no other spec in {tmp}/cdi defines ate.dev/kvm=kvm
OK    switch-mode             no move under way: the file and the running daemon are in device-plugin mode"""


class TestTypicalRun:
    async def test_text_and_json_as_printed(
        self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """The whole output of one run, byte for byte: the lines (aligned, remedy after the dash) and the JSON
        (its keys in order, indented by two)."""
        config, path = node_config(tmp_path, plugin_dir, fake_root)
        host_node(fake_root)
        mountinfo = tmp_path / "mountinfo"
        mountinfo.write_text(CGROUP2_MOUNTINFO)
        runtime = await FakeRuntime(tmp_path / "runtime.sock", "containerd", "1.7.24", containerd_info(False)).start()
        kubelet = await started_kubelet(plugin_dir)
        binary = kubelet_binary(tmp_path, "v1.31.2")
        node = Node(kernel=kernel, find_kubelet=lambda: str(binary), mountinfo=str(mountinfo))
        try:
            async with daemon_in_process(config, kernel, source=path):
                await kubelet.next_event("list")
                findings = await examine(path, node)
                running = await record_of(config)
                assert running is not None and running.pid == os.getpid()
        finally:
            await kubelet.stop()
            await runtime.stop()
        st = os.stat(fake_root / "dev" / "kvm")
        owner = f"{pwd.getpwuid(st.st_uid).pw_name}:{grp.getgrgid(st.st_gid).gr_name}"
        run = {"tmp": str(tmp_path), "daemon": running.describe(), "owner": owner, "gid": str(st.st_gid)}
        assert render_text(findings) == TYPICAL_TEXT.format(**run)
        checks = [{"check": c, "level": level, "message": m.format(**run), "remedy": r} for c, level, m, r in TYPICAL]
        summary = {"OK": 12, "WARN": 1, "FAIL": 1}
        assert render_json(findings) == json.dumps({"ok": False, "summary": summary, "checks": checks}, indent=2)
        assert failed(findings)


class TestRegistration:
    """Whether kubelet holds the resource is kubelet's word (its pod-resources API), not the daemon's file."""

    async def test_without_metrics_right_after_registration(
        self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """A default install without node_exporter (no metrics file), doctor run as soon as kubelet has the
        first list: OK from kubelet's own answer; and doctor's own ListAndWatch call is not taken by the
        daemon for kubelet's (no stream-ended, STATUS still registered)."""
        config, path = node_config(tmp_path, plugin_dir, fake_root, metrics_file="")
        host_node(fake_root)
        kubelet = await started_kubelet(plugin_dir)
        try:
            async with daemon_in_process(config, kernel) as running:
                await kubelet.next_event("list")
                findings = await examine(path, Node(kernel=kernel, find_kubelet=lambda: None))
                registered = by_check(findings)["registered ate.dev/kvm"]
                assert (registered.level, registered.message) == (
                    Level.OK,
                    "kubelet offers 4096 units of it (its pod-resources API)",
                )
                assert not running.events.named("stream-ended"), running.events.text()
                assert running.daemon.status_line().startswith("ate.dev/kvm: 4096/4096 healthy, registered | cdi:")
        finally:
            await kubelet.stop()

    async def test_kubelet_offering_none(
        self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """kubelet disconnected the resource (its connection to the plugin broke): FAIL with kubelet's own
        count, whatever the daemon's metrics file still says (the daemon's re-registration held off)."""
        monkeypatch.setattr(drops, "STREAM_GRACE", 600.0)
        config, path = node_config(tmp_path, plugin_dir, fake_root)
        host_node(fake_root)
        kubelet = await started_kubelet(plugin_dir)
        try:
            async with daemon_in_process(config, kernel):
                await kubelet.next_event("list")
                await kubelet.cut(kubelet.endpoints["ate.dev/kvm"])
                await kubelet.next_event("disconnected")
                findings = await examine(path, Node(kernel=kernel, find_kubelet=lambda: None))
                registered = by_check(findings)["registered ate.dev/kvm"]
                assert (registered.level, registered.message) == (
                    Level.FAIL,
                    "kubelet offers no unit of it (its pod-resources API)",
                )
        finally:
            await kubelet.stop()

    async def test_no_pod_resources_api(
        self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """No pod-resources socket (an old kubelet): the daemon's metrics file, and why kubelet was not asked."""
        config, path = node_config(tmp_path, plugin_dir, fake_root)
        host_node(fake_root)
        kubelet = await started_kubelet(plugin_dir)
        kubelet.pod_resources_path.unlink()
        try:
            async with daemon_in_process(config, kernel):
                await kubelet.next_event("list")
                await wait_for_content(
                    Path(config.metrics_file), 'ate_devplugd_listandwatch_streams{resource="ate.dev/kvm"} 1\n'
                )
                findings = await examine(path, Node(kernel=kernel, find_kubelet=lambda: None))
                registered = by_check(findings)["registered ate.dev/kvm"]
                assert (registered.level, registered.message) == (Level.OK, "kubelet holds its registration")
        finally:
            await kubelet.stop()


class TestFailures:
    async def test_a_node_that_cannot_run_guests(
        self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """KVM_GET_API_VERSION answers but KVM_CREATE_VM fails: FAIL, saying why; nothing else is running."""
        _, path = node_config(tmp_path, plugin_dir, fake_root)
        host_node(fake_root)
        kernel.create_vm_error = OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
        findings = await examine(path, Node(kernel=kernel, find_kubelet=lambda: None))
        checks = by_check(findings)
        kvm = checks["kvm ate.dev/kvm"]
        assert kvm.level is Level.FAIL
        name = errno.errorcode[errno.EOPNOTSUPP]
        assert f"answers KVM_GET_API_VERSION but KVM_CREATE_VM fails ({name}" in kvm.message
        assert "nested virtualisation" in kvm.message
        assert checks["daemon"].level is Level.FAIL
        assert checks["kubelet"].level is Level.FAIL
        assert checks["kubelet version"].level is Level.WARN
        assert checks["runtime"].level is Level.WARN  # no socket
        assert checks["runtime cdi"].level is Level.WARN
        assert failed(findings)

    async def test_runtime_ignoring_cdi(
        self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """containerd 1.7 with enable_cdi = false: the runtime line FAILs with the remedy; access WARNs why."""
        _, path = node_config(tmp_path, plugin_dir, fake_root)
        host_node(fake_root)
        runtime = await FakeRuntime(tmp_path / "runtime.sock", "containerd", "1.7.24", containerd_info(False)).start()
        try:
            findings = await examine(path, Node(kernel=kernel, find_kubelet=lambda: None))
        finally:
            await runtime.stop()
        checks = by_check(findings)
        cdi = checks["runtime cdi"]
        assert cdi.level is Level.FAIL
        assert cdi.message.startswith(
            "containerd 1.7.24 ignores CDI (enable_cdi = false): containers get the host's node"
        )
        assert "enable_cdi = true" in cdi.remedy
        assert checks["access ate.dev/kvm"].level is Level.WARN
        assert "gets EACCES" in checks["access ate.dev/kvm"].message

    async def test_old_kubelet_and_unreadable_dir(
        self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """kubelet 1.27 passes no CDI names (FAIL); a spec directory the runtime does not read (FAIL)."""
        _, path = node_config(tmp_path, plugin_dir, fake_root)
        host_node(fake_root, 0o666)
        runtime = await FakeRuntime(
            tmp_path / "runtime.sock", "containerd", "v2.0.0", containerd_info(True, ["/etc/cdi"])
        ).start()
        binary = kubelet_binary(tmp_path, "v1.27.9")
        try:
            findings = await examine(path, Node(kernel=kernel, find_kubelet=lambda: str(binary)))
        finally:
            await runtime.stop()
        checks = by_check(findings)
        assert checks["kubelet version"].level is Level.FAIL
        assert checks["runtime cdi"].level is Level.FAIL
        assert "leaves out" in checks["runtime cdi"].message
        assert "cdi_spec_dirs" in checks["runtime cdi"].remedy
        # a 0666 host node does not help: no container that asks for it is created
        assert checks["access ate.dev/kvm"].level is Level.WARN
        assert "unresolvable CDI devices" in checks["access ate.dev/kvm"].message

    async def test_a_directory_for_a_device_path(
        self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """A path that is a directory (``/dev/shm``) is a config error, as check-config and a reload say:
        one FAIL naming the path, with the remedy to fix the file, not to load a module."""
        config = kvm_config(plugin_dir, fake_root)
        config = dataclasses.replace(config, devices=(DeviceConfig("ate.dev/shm", "/dev/shm"),))
        (fake_root / "dev" / "shm").mkdir()
        path = tmp_path / "config.toml"
        path.write_text(render(config))
        findings = await examine(path, Node(kernel=kernel, find_kubelet=lambda: None))
        (found,) = findings
        assert found.check == "config" and found.level is Level.FAIL
        assert "'/dev/shm' is a directory" in found.message and "module" not in found.remedy, found

    async def test_missing_config_names_the_path_once(self, tmp_path: Path, kernel: FakeKernel) -> None:
        """A --config that does not exist: one FAIL, the path once, the reason in words."""
        missing = tmp_path / "nope.toml"
        (finding,) = await examine(missing, Node(kernel=kernel))
        assert (finding.check, finding.level) == ("config", Level.FAIL)
        assert finding.message == f"cannot read {missing}: No such file or directory"


class TestWhichRuntime:
    async def test_kubelets_config_file_names_it(
        self, tmp_path: Path, plugin_dir: Path, fake_root: Path, kernel: FakeKernel
    ) -> None:
        """No runtime_socket: the running kubelet's config file (found through a fake /proc) names the
        socket; doctor asks that runtime and says why it did."""
        _, path = node_config(tmp_path, plugin_dir, fake_root, runtime_socket="")
        host_node(fake_root)
        socket = tmp_path / "k3s.sock"
        kubelet_config = tmp_path / "kubelet.yaml"
        kubelet_config.write_text(f"kind: KubeletConfiguration\ncontainerRuntimeEndpoint: unix://{socket}\n")
        proc = tmp_path / "proc" / "4242"
        proc.mkdir(parents=True)
        (proc / "comm").write_text("kubelet\n")
        (proc / "cmdline").write_bytes(b"/usr/bin/kubelet\0--config\0kubelet.yaml\0")
        (proc / "cwd").symlink_to(tmp_path)
        runtime = await FakeRuntime(socket, "containerd", "2.1.9+unknown", containerd_info(True)).start()
        try:
            node = Node(kernel=kernel, find_kubelet=lambda: None, proc_root=str(tmp_path / "proc"))
            findings = await examine(path, node)
        finally:
            await runtime.stop()
        where = proc / "cwd" / "kubelet.yaml"
        want = f"containerd 2.1.9 at {socket} (containerRuntimeEndpoint in kubelet's {where} (pid 4242))"
        assert by_check(findings)["runtime"].message == want


class TestOutput:
    def test_lines_and_json(self) -> None:
        """One line each, remedy after the dash; JSON carries the same with a summary and ok."""
        findings = [
            Finding("config", Level.OK, "defaults"),
            Finding("kubelet", Level.FAIL, "no kubelet.sock", "systemctl start kubelet"),
        ]
        assert render_text(findings).splitlines() == [
            "OK    config   defaults",
            "FAIL  kubelet  no kubelet.sock -- systemctl start kubelet",
        ]
        doc = json.loads(render_json(findings))
        assert doc["ok"] is False
        assert doc["summary"] == {"OK": 1, "WARN": 0, "FAIL": 1}
        assert doc["checks"][1] == {
            "check": "kubelet",
            "level": "FAIL",
            "message": "no kubelet.sock",
            "remedy": "systemctl start kubelet",
        }

    def test_bad_config_exits_1(self, tmp_path: Path, capsys: object) -> None:
        """A config that does not load is a FAIL naming the field; the exit status is 1."""
        bad = tmp_path / "config.toml"
        bad.write_text('runtime_socket = "relative.sock"\n')
        assert cli.main(["doctor", "--json", "--config", str(bad)]) == 1
        out = capsys.readouterr().out  # type: ignore[attr-defined]
        doc = json.loads(out)
        assert doc["checks"][0]["check"] == "config"
        assert "runtime_socket: must be an absolute path" in doc["checks"][0]["message"]


#: The driver's service account's token (dra-manifests binds the account; the fake judges it by that RBAC).
SA_TOKEN = "s3rvice-account-t0ken"
API_CHECKS = ("apiserver", "deviceclass", "slice")


def dra_node(
    tmp_path: Path, fake_root: Path, url: str, token: str, sharing: Layout | None = Layout.UNITS
) -> tuple[Path, DraConfig]:
    """A DRA-mode config file whose kubeconfig carries ``token``, and its [dra] table (kubelet's directory
    is never made: its name only has to leave socket paths short enough); ``sharing`` as given (None: not set)."""
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", url, token=token)
    path = tmp_path / "config.toml"
    path.write_text(
        f'mode = "dra"\ndev_root = "{fake_root}"\ncdi_dir = "{tmp_path / "cdi"}"\nmetrics_file = ""\n'
        f'runtime_socket = "{tmp_path / "runtime.sock"}"\nplugin_dir = "{tmp_path / "dp"}"\n'
        f'[dra]\nnode_name = "{NODE}"\nkubeconfig = "{kubeconfig}"\nkubelet_dir = "/nonexistent/kubelet"\n'
        + (f'sharing = "{sharing}"\n' if sharing is not None else "")
    )
    return path, DraConfig(node_name=NODE, kubeconfig=str(kubeconfig), sharing=sharing)


def publish(api: FakeApiServer, dra: DraConfig, layout: Layout | None = None) -> None:
    """This node's slice of ate.dev/kvm, as the daemon publishes it (in ``layout``: by default the configured)."""
    pool = build_pools(dra, [DraResource("ate.dev/kvm", "ate.dev/kvm=kvm")], layout)[0][0]
    api.slices["s1"] = {"metadata": {"name": "s1"}, "spec": slice_spec(dra, pool, 1, present=True)}


def api_checks(findings: list[Finding]) -> dict[str, Finding]:
    return {f.check: f for f in findings if f.check.startswith(API_CHECKS)}


class TestDraMode:
    async def test_kubelet_credentials(self, tmp_path: Path, fake_root: Path, kernel: FakeKernel) -> None:
        """kubelet's own credentials: the API server answers and the slice is checked (none: FAIL; with
        devices: OK), but a node may not list DeviceClasses (the Node authorizer's rules), which is one WARN
        that says so and gives the administrator's command, never an OK for a class it could not see."""
        api = FakeApiServer(NODE, token=TOKEN)
        await api.start()
        try:
            path, dra = dra_node(tmp_path, fake_root, api.url, TOKEN)
            api.create(manifests.device_class(dra, "ate.dev/kvm"))
            node = Node(kernel=kernel, find_kubelet=lambda: None)
            checks = api_checks(await examine(path, node))
            assert checks["apiserver"].level is Level.OK
            assert checks["slice ate.dev/kvm"].level is Level.FAIL
            refused = checks["deviceclass"]
            assert refused.level is Level.WARN
            assert "these credentials may not list DeviceClasses" in refused.message
            assert 'User "system:node:node-1" cannot list resource "deviceclasses"' in refused.message
            assert refused.remedy.startswith("an administrator runs: kubectl get deviceclass")
            assert "deviceclass ate.dev/kvm" not in checks

            publish(api, dra)
            checks = api_checks(await examine(path, node))
            assert checks["slice ate.dev/kvm"].level is Level.OK
            assert checks["slice ate.dev/kvm"].message == "s1 published with 128 device(s)"
            assert [c for c, f in checks.items() if f.level is not Level.OK] == ["deviceclass"]

            # the read-only role of dra-manifests --kubelet-credentials: the class is read back
            api.create(*manifests.node_read_objects(dra))
            checks = api_checks(await examine(path, node))
            assert checks["deviceclass ate.dev/kvm"].level is Level.OK, checks
            # an API server without DRAExtendedResource stores the class without extendedResourceName
            api.objects.pop(("DeviceClass", "", "kvm.ate.dev"))
            api.extended_resource = False
            api.create(manifests.device_class(dra, "ate.dev/kvm"))
            dropped = api_checks(await examine(path, node))["deviceclass ate.dev/kvm"]
            assert dropped.level is Level.FAIL
            assert dropped.message.startswith("DeviceClass kvm.ate.dev is stored without extendedResourceName")
            assert "DRAExtendedResource feature gate is off" in dropped.message
            assert "DRAExtendedResource=true in kube-apiserver" in dropped.remedy
        finally:
            await api.stop()

    async def test_service_account_credentials(self, tmp_path: Path, fake_root: Path, kernel: FakeKernel) -> None:
        """The service account with what ``dra-manifests`` prints applied: a correct node prints only OK lines;
        the DeviceClass gone is a FAIL naming the command; a ClusterRole without the DeviceClass read is the
        same WARN as kubelet's credentials get."""
        api = FakeApiServer(NODE, service_account_token=SA_TOKEN)
        await api.start()
        try:
            path, dra = dra_node(tmp_path, fake_root, api.url, SA_TOKEN)
            api.create(*(d for d in yaml.safe_load_all(manifests.render(dra, ["ate.dev/kvm"])) if d is not None))
            publish(api, dra)
            node = Node(kernel=kernel, find_kubelet=lambda: None)
            checks = api_checks(await examine(path, node))
            assert {c: f.level for c, f in checks.items()} == {
                "apiserver": Level.OK,
                "deviceclass ate.dev/kvm": Level.OK,
                "slice ate.dev/kvm": Level.OK,
            }
            assert checks["deviceclass ate.dev/kvm"].message == "kvm.ate.dev has extendedResourceName ate.dev/kvm"

            klass = api.objects.pop(("DeviceClass", "", "kvm.ate.dev"))
            checks = api_checks(await examine(path, node))
            assert checks["deviceclass ate.dev/kvm"].level is Level.FAIL
            assert "dra-manifests" in checks["deviceclass ate.dev/kvm"].remedy

            api.objects["DeviceClass", "", "kvm.ate.dev"] = klass
            role = api.objects["ClusterRole", "", manifests.access_name(dra)]
            role["rules"] = [r for r in role["rules"] if r["resources"] != ["deviceclasses"]]
            checks = api_checks(await examine(path, node))
            assert checks["deviceclass"].level is Level.WARN
            assert 'User "system:serviceaccount:ate-devplugd:ate-devplugd" cannot list' in checks["deviceclass"].message
            assert checks["slice ate.dev/kvm"].level is Level.OK
        finally:
            await api.stop()

    async def test_layout(self, tmp_path: Path, fake_root: Path, kernel: FakeKernel) -> None:
        """The layout is said (set in config, or decided from the API server's answer to a dry-run create),
        and a published slice of the other layout is a WARN saying what to do."""
        api = FakeApiServer(NODE, token=TOKEN)
        await api.start()
        try:
            node = Node(kernel=kernel, find_kubelet=lambda: None)
            path, dra = dra_node(tmp_path, fake_root, api.url, TOKEN, sharing=None)
            publish(api, dra, Layout.UNITS)  # a daemon that started while the gate was off
            findings = {f.check: f for f in await examine(path, node)}
            assert findings["layout"].level is Level.OK
            assert findings["layout"].message == "shared (decided: the API server keeps allowMultipleAllocations)"
            stale = [f for f in findings.values() if f.check == "slice ate.dev/kvm" and f.level is Level.WARN]
            assert len(stale) == 1 and "128 exclusive device(s), not the layout shared" in stale[0].message
            assert stale[0].remedy.startswith("systemctl restart ate-devplugd")

            api.consumable_capacity = False
            findings = {f.check: f for f in await examine(path, node)}
            assert findings["layout"].message.startswith(
                "units (decided: the API server drops allowMultipleAllocations"
            )
            assert findings["slice ate.dev/kvm"].level is Level.OK

            path, dra = dra_node(tmp_path, fake_root, api.url, TOKEN, sharing=Layout.SHARED)
            publish(api, dra)
            api.slices["s1"]["spec"]["devices"][0].pop("allowMultipleAllocations")  # as the API server stored it
            levels = [(f.check, f.level) for f in await examine(path, node) if f.check.startswith(("layout", "slice"))]
            assert levels == [("layout", Level.OK), ("slice ate.dev/kvm", Level.OK), ("slice ate.dev/kvm", Level.WARN)]
            findings = [f for f in await examine(path, node) if f.level is Level.WARN and f.check.startswith("slice")]
            assert "DRAConsumableCapacity" in findings[0].remedy and api.dry_runs == 2
        finally:
            await api.stop()

    async def test_unreachable(self, tmp_path: Path, fake_root: Path, kernel: FakeKernel) -> None:
        """An API server nobody answers for: one FAIL naming it."""
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", "http://127.0.0.1:9")
        path = tmp_path / "config.toml"
        path.write_text(
            f'mode = "dra"\ndev_root = "{fake_root}"\nmetrics_file = ""\nplugin_dir = "{tmp_path / "dp"}"\n'
            f'runtime_socket = "{tmp_path / "runtime.sock"}"\n'
            f'[dra]\nnode_name = "{NODE}"\nkubeconfig = "{kubeconfig}"\n'
        )
        checks = by_check(await examine(path, Node(kernel=kernel, find_kubelet=lambda: None)))
        assert checks["apiserver"].level is Level.FAIL
        assert "http://127.0.0.1:9 cannot be reached" in checks["apiserver"].message


def kubelet_proc(tmp_path: Path, *flags: str, file_gates: str = "") -> Path:
    """A ``/proc`` holding a kubelet process: its command line and the config file it names."""
    proc = tmp_path / "proc"
    (proc / "4242").mkdir(parents=True)
    config = tmp_path / "kubelet-config.yaml"
    config.write_text("kind: KubeletConfiguration\n" + file_gates)
    (proc / "4242" / "comm").write_text("kubelet\n")
    argv = ["/usr/bin/kubelet", "--config", str(config), *flags]
    (proc / "4242" / "cmdline").write_bytes(b"".join(a.encode() + b"\0" for a in argv))
    (proc / "4242" / "cwd").symlink_to("/")
    return proc


class TestDraGates:
    """kubelet's DRAExtendedResource as its command line and config file set it, not guessed from its version."""

    @pytest.mark.parametrize(
        "case",
        [
            ("v1.35.3", (), "", Level.FAIL),  # alpha: off by default
            ("v1.35.3", ("--feature-gates=DRAExtendedResource=true",), "", Level.OK),
            ("v1.34.2", (), "featureGates:\n  DRAExtendedResource: true\n", Level.OK),
            ("v1.36.2", (), "", Level.OK),  # beta: on by default
            ("v1.36.2", ("--feature-gates=DRAExtendedResource=false",), "", Level.FAIL),
            ("v1.33.4", (), "", Level.FAIL),  # too old for DRA mode
        ],
    )
    async def test_kubelet_gates(
        self, tmp_path: Path, fake_root: Path, kernel: FakeKernel, case: tuple[str, tuple[str, ...], str, Level]
    ) -> None:
        version, flags, file_gates, level = case
        path, _ = dra_node(tmp_path, fake_root, "http://127.0.0.1:9", TOKEN)
        binary = kubelet_binary(tmp_path, version)
        proc = kubelet_proc(tmp_path, *flags, file_gates=file_gates)
        node = Node(kernel=kernel, find_kubelet=lambda: str(binary), proc_root=str(proc))
        found = {f.check: f for f in await examine(path, node)}["kubelet version"]
        assert found.level is level, found
        if version >= "v1.34" and level is Level.FAIL:
            assert "DRAExtendedResource off" in found.message, found
            assert found.remedy.startswith("turn on DRAExtendedResource=true in kubelet (--feature-gates="), found
        if level is Level.OK:
            assert "DRAExtendedResource on" in found.message and "kube-scheduler's cannot be seen" in found.message
