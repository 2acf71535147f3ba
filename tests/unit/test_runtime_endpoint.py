"""Which CRI socket is asked: ours, else kubelet's flag, else kubelet's config file, else the usual ones.

The parsing and the order are pure (``cri.endpoint``); ``cri.ask.read_kubelet`` is run on a fake
``/proc`` in a temp directory (``comm``, ``cmdline`` with NULs, ``cwd`` a symlink, as the kernel has them)."""

from __future__ import annotations

import json
from pathlib import Path

from ate_devplugd.cri.ask import discover, read_kubelet
from ate_devplugd.cri.endpoint import (
    DEFAULT_RUNTIME_SOCKETS,
    Kubelet,
    Source,
    choose,
    config_endpoint,
    config_file,
    flag,
    socket_path,
)

CONFIG = """\
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: systemd
containerRuntimeEndpoint: "unix:///run/k3s/containerd/containerd.sock"
"""


class TestParsing:
    def test_flag_forms_and_the_last_wins(self) -> None:
        argv = ["kubelet", "--config=/a.yaml", "--v", "2", "--config", "/b.yaml", "--x"]
        assert flag(argv, "--config") == "/b.yaml"
        assert flag(["kubelet", "--config"], "--config") is None
        assert flag(["kubelet", "--configs=/x"], "--config") is None
        assert flag(["--config=/x"], "--config") is None  # argv[0] is the program

    def test_socket_path(self) -> None:
        assert socket_path("unix:///run/containerd/containerd.sock") == "/run/containerd/containerd.sock"
        assert socket_path("/var/run/crio/crio.sock") == "/var/run/crio/crio.sock"
        assert socket_path("npipe:////./pipe/containerd-containerd") is None
        assert socket_path("tcp://10.0.0.1:1234") is None
        assert socket_path("relative.sock") is None

    def test_config_file_yaml_and_json(self) -> None:
        assert config_endpoint(CONFIG) == "unix:///run/k3s/containerd/containerd.sock"
        assert config_endpoint(json.dumps({"containerRuntimeEndpoint": "/run/crio/crio.sock"})) == "/run/crio/crio.sock"
        assert config_endpoint("kind: KubeletConfiguration\n") is None
        assert config_endpoint("{not json") is None
        assert config_endpoint(": : :\n- [") is None

    def test_config_path_relative_to_kubelets_cwd(self) -> None:
        assert config_file(["kubelet", "--config=c.yaml"], "/proc/9/cwd") == "/proc/9/cwd/c.yaml"
        assert config_file(["kubelet", "--config=/etc/k.yaml"], "/proc/9/cwd") == "/etc/k.yaml"
        assert config_file(["kubelet"], "/proc/9/cwd") == ""


class TestOrder:
    def test_ours_wins(self) -> None:
        kubelet = Kubelet(7, ("kubelet", "--container-runtime-endpoint=unix:///k.sock"))
        chosen = choose("/ours.sock", kubelet)
        assert (chosen.socket, chosen.source, chosen.named) == ("/ours.sock", Source.CONFIG, True)
        assert chosen.why == "runtime_socket in our config"

    def test_kubelets_flag_over_its_file(self) -> None:
        argv = ("kubelet", "--config=/etc/k.yaml", "--container-runtime-endpoint", "unix:///run/x/x.sock")
        chosen = choose("", Kubelet(7, argv, "/etc/k.yaml", CONFIG))
        assert (chosen.socket, chosen.source) == ("/run/x/x.sock", Source.KUBELET_FLAG)
        assert chosen.why == "kubelet's --container-runtime-endpoint (pid 7)"

    def test_kubelets_file(self) -> None:
        chosen = choose("", Kubelet(7, ("kubelet", "--config=/etc/k.yaml"), "/etc/k.yaml", CONFIG))
        assert (chosen.socket, chosen.source) == ("/run/k3s/containerd/containerd.sock", Source.KUBELET_CONFIG)
        assert chosen.why == "containerRuntimeEndpoint in kubelet's /etc/k.yaml (pid 7)"

    def test_the_usual_sockets(self) -> None:
        assert "/run/k3s/containerd/containerd.sock" in DEFAULT_RUNTIME_SOCKETS
        for kubelet, why in [
            (None, "no kubelet running"),
            (Kubelet(7, ("kubelet",)), "kubelet (pid 7) names no runtime endpoint"),
            (Kubelet(7, ("kubelet", "--config=/k.yaml"), "/k.yaml", "kind: X\n"), "kubelet (pid 7) names no"),
            (Kubelet(7, ("kubelet", "--container-runtime-endpoint=tcp://h:1")), "tcp://h:1 is not a unix socket"),
        ]:
            chosen = choose("", kubelet)
            assert (chosen.socket, chosen.source, chosen.named) == ("", Source.USUAL, False)
            assert why in chosen.why


def fake_proc(root: Path, pid: int, comm: str, argv: list[str], cwd: Path) -> None:
    base = root / str(pid)
    base.mkdir(parents=True)
    (base / "comm").write_text(comm + "\n")
    (base / "cmdline").write_bytes(b"".join(arg.encode() + b"\0" for arg in argv))
    (base / "cwd").symlink_to(cwd)


class TestProc:
    def test_kubelet_found_by_its_name_with_its_config(self, tmp_path: Path) -> None:
        proc, home = tmp_path / "proc", tmp_path / "var-lib-kubelet"
        home.mkdir()
        (home / "config.yaml").write_text(CONFIG)
        fake_proc(proc, 1, "systemd", ["/sbin/init"], tmp_path)
        fake_proc(proc, 40, "containerd", ["/usr/bin/containerd"], tmp_path)
        fake_proc(proc, 321, "kubelet", ["/usr/bin/kubelet", "--config=config.yaml", "--v=2"], home)
        (proc / "self").mkdir()
        kubelet = read_kubelet(str(proc))
        assert kubelet is not None
        assert (kubelet.pid, kubelet.argv[1]) == (321, "--config=config.yaml")
        assert kubelet.config_path == str(proc / "321" / "cwd" / "config.yaml")
        assert kubelet.config_text == CONFIG
        chosen = discover("", str(proc))
        assert (chosen.socket, chosen.source) == ("/run/k3s/containerd/containerd.sock", Source.KUBELET_CONFIG)

    def test_flag_and_unreadable_config(self, tmp_path: Path) -> None:
        proc = tmp_path / "proc"
        argv = ["kubelet", "--config", "/nonexistent.yaml", "--container-runtime-endpoint=unix:///run/crio/crio.sock"]
        fake_proc(proc, 5, "kubelet", argv, tmp_path)
        kubelet = read_kubelet(str(proc))
        assert kubelet is not None and kubelet.config_text is None
        assert discover("", str(proc)).socket == "/run/crio/crio.sock"
        assert discover("/mine.sock", str(proc)).why == "runtime_socket in our config"

    def test_no_kubelet(self, tmp_path: Path) -> None:
        proc = tmp_path / "proc"
        fake_proc(proc, 1, "systemd", ["/sbin/init"], tmp_path)
        assert read_kubelet(str(proc)) is None
        assert read_kubelet(str(tmp_path / "missing")) is None
        assert discover("", str(proc)).source is Source.USUAL
